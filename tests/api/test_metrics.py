"""/metrics: Prometheus text that parses, with counters that move as requests complete."""
from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.api.api_support import MODEL

EXPECTED = [
    "nightjar:spec_decode_num_drafts", "nightjar:spec_decode_num_draft_tokens",
    "nightjar:spec_decode_num_accepted_tokens", "nightjar:spec_decode_num_accepted_tokens_per_pos",
    "nightjar:time_to_first_token_seconds", "nightjar:time_per_output_token_seconds",
    "nightjar:e2e_request_latency_seconds", "nightjar:num_requests_running", "nightjar:num_requests_waiting",
    "nightjar:kv_blocks_total", "nightjar:kv_blocks_free", "nightjar:generation_tokens", "nightjar:request_success",
    "nightjar:spec_gamma", "nightjar:draft_resident", "nightjar:draft_offloads", "nightjar:draft_reloads",
    "nightjar:draft_offload_seconds", "nightjar:draft_reload_seconds", "nightjar:kv_pool_resizes",
    "nightjar:kv_blocks_migrated", "nightjar:spec_row_gamma",
]


async def scrape(s) -> dict[str, float]:
    async with s.get("/metrics") as r:
        assert r.status == 200 and r.content_type == "text/plain"
        text = await r.text()
    samples, families = {}, set()
    for fam in text_string_to_metric_families(text):
        families.add(fam.name)
        for sm in fam.samples:
            key = sm.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sm.labels.items()) if k != "le")
            if "le" in sm.labels:
                key += f"[le={sm.labels['le']}]"
            samples[key] = sm.value
    missing = [n for n in EXPECTED if n not in families]
    assert not missing, missing
    return samples


def run_chat(s, max_tokens: int, **extra):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, **extra}
    return s.post("/v1/chat/completions", json=body)


async def test_request_counters_and_latency_histograms_move(serve):
    srv = await serve("off")
    async with aiohttp.ClientSession(srv.url) as s:
        before = await scrape(s)
        assert before["nightjar:kv_blocks_total"] == before["nightjar:kv_blocks_free"] == 256
        for _ in range(3):
            async with run_chat(s, 5) as r:
                assert r.status == 200
        async with run_chat(s, 4, stream=True) as r:
            assert r.status == 200 and (await r.read()).endswith(b"data: [DONE]\n\n")
        after = await scrape(s)
    assert after["nightjar:request_success_total{finish_reason=length}"] == 4
    assert after["nightjar:request_success_total{finish_reason=stop}"] == 0
    assert after["nightjar:generation_tokens_total"] == 3 * 5 + 4
    assert after["nightjar:e2e_request_latency_seconds_count"] == 4
    assert after["nightjar:time_to_first_token_seconds_count"] == 4
    assert after["nightjar:time_per_output_token_seconds_count"] == 4
    assert after["nightjar:prompt_tokens_total"] > 0
    assert after["nightjar:num_requests_running"] == 0
    assert after["nightjar:spec_decode_num_drafts_total"] == 0          # policy off: no drafting
    assert after["nightjar:spec_gamma_count"] > 0
    assert after["nightjar:spec_gamma_bucket[le=0.0]"] == after["nightjar:spec_gamma_count"]


async def test_speculative_counters_follow_vllms_schema_and_respect_the_per_request_opt_out(serve):
    srv = await serve("fixed:3")
    async with aiohttp.ClientSession(srv.url) as s:
        base = await scrape(s)
        assert base["nightjar:draft_resident"] == 1
        async with run_chat(s, 8, nightjar={"speculate": False}) as r:
            assert r.status == 200
        off = await scrape(s)
        assert off["nightjar:spec_decode_num_drafts_total"] == base["nightjar:spec_decode_num_drafts_total"]
        async with run_chat(s, 12) as r:
            assert r.status == 200
        on = await scrape(s)
    drafts = on["nightjar:spec_decode_num_drafts_total"]
    accepted = on["nightjar:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0
    assert on["nightjar:spec_decode_num_draft_tokens_total"] == 3 * drafts
    assert 0 <= accepted <= 3 * drafts
    per_pos = [on[f"nightjar:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"] for i in range(3)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert on["nightjar:spec_gamma_bucket[le=3.0]"] - on["nightjar:spec_gamma_bucket[le=2.0]"] > 0
    assert on["nightjar:generation_tokens_total"] == 20


async def test_state_changes_reach_metrics_and_the_log(serve, caplog):
    from nightjar.api.app import STATE
    from nightjar.kernel.bus import Envelope
    from nightjar.kernel.messages import DraftOffloaded, DraftReloaded, DraftResidency, PoolResized

    srv = await serve("fixed:2")
    caplog.set_level("INFO", logger="nightjar.api")
    st = srv.app[STATE]
    facts = [DraftOffloaded(bytes_moved=3 << 20, duration_s=0.004, freed_blocks=10),
             DraftResidency(resident=False, state="OFFLOADED"),
             PoolResized(num_total=266, delta=10, migrated=2, duration_s=0.001),
             DraftReloaded(bytes_moved=3 << 20, duration_s=0.006), DraftResidency(resident=True, state="RESIDENT")]
    for i, msg in enumerate(facts):       # straight into the taps: publishing would move the real batcher
        env = Envelope(10_000 + i, 0.0, "test", msg)
        st.metrics.tap(env)
        st.states.tap(env)
    async with aiohttp.ClientSession(srv.url) as s:
        m = await scrape(s)
    assert m["nightjar:draft_offloads_total"] == m["nightjar:draft_reloads_total"] == 1
    assert m["nightjar:draft_offload_seconds_count"] == m["nightjar:draft_reload_seconds_count"] == 1
    assert m["nightjar:kv_pool_resizes_total"] == 1 and m["nightjar:kv_blocks_migrated_total"] == 2
    assert m["nightjar:draft_resident"] == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "nightjar.api"]
    assert "draft offloaded: 3.0 MiB in 4.0 ms, pool may grow by 10 blocks" in lines
    assert "KV pool resized by +10 blocks to 266 (2 migrated, 1.0 ms)" in lines
    assert "draft reloaded: 3.0 MiB in 6.0 ms" in lines
    assert "draft not resident (OFFLOADED)" in lines and "draft resident (RESIDENT)" in lines


def test_a_failing_tap_handler_never_raises_into_the_bus():
    from nightjar.api.metrics import ServerMetrics
    from nightjar.kernel.bus import Envelope
    from nightjar.kernel.messages import StepTimed

    m = ServerMetrics(gamma_max=2)
    bad = StepTimed(step=1, batch_size=1, gamma=2, step_time_s=0.01, tokens_emitted=1,
                    accepted_per_pos=(1, "x"), num_drafts=1)        # a malformed fact: sum() raises
    m.tap(Envelope(1, 0.0, "verifier", bad))
    m.tap(Envelope(2, 0.0, "verifier", bad))


def test_the_per_row_gamma_distribution_counts_rows_of_both_step_forms():
    from nightjar.api.metrics import ServerMetrics
    from nightjar.kernel.bus import Envelope
    from nightjar.kernel.messages import StepTimed

    m = ServerMetrics(gamma_max=4)
    batch = StepTimed(step=1, batch_size=5, gamma=2, step_time_s=0.01, tokens_emitted=7, accepted_per_pos=(2, 0),
                      num_drafts=4)                                     # 4 rows at γ=2, 1 that does not draft
    per_row = StepTimed(step=2, batch_size=4, gamma=3, step_time_s=0.01, tokens_emitted=6, accepted_per_pos=(2, 0, 0),
                        num_drafts=3, drafted_per_pos=(3, 2, 1), reached_per_pos=(3, 2, 0))   # γ_i = 0, 1, 2, 3
    m.tap(Envelope(1, 0.0, "verifier", batch))
    m.tap(Envelope(2, 0.0, "verifier", per_row))
    rows = {g: m.spec_row_gamma.labels(gamma=str(g))._value.get() for g in range(5)}
    assert rows == {0: 2, 1: 1, 2: 5, 3: 1, 4: 0}
    assert m.num_draft_tokens._value.get() == 4 * 2 + (3 + 2 + 1)
