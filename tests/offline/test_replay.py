"""Control-plane replay: recorded engine runs replay with zero divergence; hand-built traces give
known planner decisions; a tampered decision is reported at its seq; damaged files exit 2."""
from __future__ import annotations

import asyncio
import copy
from collections import Counter
from pathlib import Path

import pytest

from nightjar.kernel.bus import Envelope
from nightjar.kernel.messages import DraftResidency, StepPlanned, StepScheduled, StepTimed
from nightjar.kernel.trace import TraceWriter
from nightjar.models import LoadedModel
from nightjar.offline.replay import full_replay, replay_file
from nightjar.offline.replay import main as replay_main
from nightjar.sampling import SamplingParams

GOLDEN = sorted((Path(__file__).parent / "replay").glob("*.njtrace"))


def private_pair(pair):
    """The elastic weight mover may release the draft's weights (offload) and an engine stopped then
    leaves them released: give such runs their own copy of the session's draft."""
    target, draft = pair
    return target, LoadedModel(copy.deepcopy(draft.model), draft.tokenizer, draft.source)


def record_run(make_engine, path, policy, n=6, pair=None, **kw):
    async def main():
        async with make_engine(policy, pair=pair, trace=str(path), num_blocks=40, block_size=8, max_num_seqs=4,
                               gamma_max=3, **kw) as eng:
            async def one(i):
                await asyncio.sleep(0.002 * i)
                sp = SamplingParams(max_tokens=6 + 2 * i, ignore_eos=True, temperature=0.0 if i % 2 else 0.7,
                                    seed=i if i % 3 == 0 else None)
                return [t async for o in eng.generate(list(range(100 + i, 118 + 3 * i)), sp) for t in o.token_ids]
            return await asyncio.gather(*[one(i) for i in range(n)])
    return asyncio.run(main())


@pytest.mark.parametrize("policy", ["fixed:2", "nightjar"])
def test_a_recorded_engine_run_replays_with_zero_divergence(make_engine, tiny_pair, tmp_path, policy):
    path = tmp_path / "run.njtrace"
    record_run(make_engine, path, policy, pair=private_pair(tiny_pair))
    res = replay_file(str(path))
    assert res.ok, res.summary()
    assert res.checked["batcher"] > 10 and res.checked["planner"] > 5 and res.checked["kv"] > 5
    assert replay_main([str(path)]) == 0


def test_full_replay_reproduces_the_greedy_tokens(make_engine, tiny_pair, tmp_path):
    path = tmp_path / "run.njtrace"
    record_run(make_engine, path, "fixed:2", n=4)
    res = full_replay(str(path), loaded=tiny_pair)
    assert res.ok and res.exact >= 2, res.details


def test_full_replay_reproduces_seeded_sampled_tokens_under_the_adaptive_policy(make_engine, tiny_pair, tmp_path):
    path = tmp_path / "run.njtrace"
    record_run(make_engine, path, "nightjar", n=6, pair=private_pair(tiny_pair))
    res = full_replay(str(path), loaded=private_pair(tiny_pair))
    assert res.ok and res.exact >= 4, res.details     # 3 greedy + 1 seeded sampled request, all exact


def test_the_golden_traces_are_here_and_cover_what_they_promise():
    from nightjar.kernel.messages import CancelRequest, DraftOffloaded, DraftReloaded, RequestAdmitted
    from nightjar.kernel.trace import TraceReader

    assert GOLDEN, "no golden traces in tests/offline/replay (record them: tests/offline/replay/record_golden.py)"
    seen = {}
    for path in GOLDEN:
        reader = TraceReader(str(path), allow_schema_drift=True)
        msgs = [e.msg for e in reader]
        seeded = ["sampled" for m in msgs if isinstance(m, RequestAdmitted)
                  and m.sampling.temperature > 0 and m.sampling.seed is not None]
        seen[reader.header["config"]["policy"]] = [type(m) for m in msgs] + seeded
    assert set(seen) == {"off", "fixed:2", "nightjar"}
    assert DraftOffloaded in seen["nightjar"] and DraftReloaded in seen["nightjar"]
    assert all(CancelRequest in kinds and "sampled" in kinds for kinds in seen.values())


@pytest.mark.parametrize("golden", GOLDEN, ids=[p.name for p in GOLDEN])
def test_golden_traces_replay_with_zero_divergence(golden):
    res = replay_file(str(golden), allow_schema_drift=True)
    assert res.ok, res.summary()


# ---- hand-built traces -------------------------------------------------------------------------------
def sched(step, num_decode):
    return StepScheduled(step=step, req_ids=tuple(range(num_decode)), starts=(10,) * num_decode,
                         chunk_ids=((5,),) * num_decode, num_decode=num_decode, draft_computed=(10,) * num_decode,
                         speculate=(True,) * num_decode, prefill_done=())


TABLE = "table:1-2:3,3-4:2,5-:0"
# (batch size, γ planned, next_zero): the table's γ; a 0 it gives is held for the next step (a run-ahead may
# start it), so the step after (8, 0) plans 0 and the table's 3 comes one step later
KNOWN = [(1, 3, False), (2, 3, False), (3, 2, False), (4, 2, False), (5, 0, True), (8, 0, True), (1, 0, False),
         (1, 3, False)]


def hand_built(path, tamper_step=None):
    header = {"config": {"policy": TABLE, "gamma_max": 3, "seed": 0}, "num_blocks": 64, "vocab_size": 100,
              "eos_token_ids": [2], "max_position": 512, "draft": "d"}
    seq = 0
    with TraceWriter(path, header) as w:
        def put(src, msg):
            nonlocal seq
            seq += 1
            w.write(Envelope(seq, 0.01 * seq, src, msg))
            return seq
        put("weights", DraftResidency(resident=True, state="RESIDENT"))
        tampered = None
        for step, (b, gamma, nz) in enumerate(KNOWN, start=1):
            put("batcher", sched(step, b))
            g = gamma + 1 if step == tamper_step else gamma
            s = put("planner", StepPlanned(step=step, gamma=g, next_zero=nz))
            tampered = s if step == tamper_step else tampered
            put("verifier", StepTimed(step=step, batch_size=b, gamma=g, step_time_s=0.01, tokens_emitted=b))
    return tampered


def test_a_hand_built_trace_reproduces_the_known_table_decisions(tmp_path):
    path = tmp_path / "hand.njtrace"
    hand_built(path)
    res = replay_file(str(path), actors=["planner", "weights"], oracle=["weights"])
    assert res.ok, res.summary()
    assert res.checked["planner"] == len(KNOWN)


def test_a_tampered_decision_is_reported_at_its_seq(tmp_path, capsys):
    path = tmp_path / "hand.njtrace"
    seq = hand_built(path, tamper_step=4)
    res = replay_file(str(path), actors=["planner"])
    assert not res.ok and res.divergence.seq == seq and res.divergence.actor == "planner"
    assert res.divergence.expected.msg.gamma == 3 and res.divergence.got.gamma == 2
    assert replay_main([str(path), "--actors", "planner"]) == 1
    out = capsys.readouterr().out
    assert f"divergence at seq {seq} in actor 'planner'" in out


def test_an_actor_that_cannot_be_built_is_an_error_unless_asked_to_be_an_oracle(tmp_path, capsys):
    path = tmp_path / "hand.njtrace"
    header = {"config": {"policy": "fixed:9", "gamma_max": 3}, "num_blocks": 64, "vocab_size": 100,
              "draft": "d", "eos_token_ids": [2]}
    with TraceWriter(path, header) as w:
        w.write(Envelope(1, 0.01, "batcher", sched(1, 2)))
    assert replay_main([str(path), "--actors", "planner"]) == 1
    assert "cannot build the planner actor" in capsys.readouterr().err
    assert replay_main([str(path), "--actors", "planner", "--oracle", "planner"]) == 0
    assert replay_main([str(path), "--actors", "planner,nosuch"]) == 2
    assert "unknown actor(s) nosuch" in capsys.readouterr().err


def test_until_stops_early_and_show_prints_matching_envelopes(tmp_path, capsys):
    path = tmp_path / "hand.njtrace"
    seq = hand_built(path, tamper_step=6)
    assert replay_main([str(path), "--actors", "planner", "--until", str(seq - 1), "--show", "StepPlanned"]) == 0
    out = capsys.readouterr().out
    assert out.count('"type":"StepPlanned"') == 5


def test_a_damaged_file_exits_2(tmp_path, capsys):
    path = tmp_path / "hand.njtrace"
    hand_built(path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert replay_main([str(path)]) == 2
    assert "CRC" in capsys.readouterr().err


def test_trace_summary_prints_a_phase_table_and_draws_a_timeline(tmp_path, capsys):
    from nightjar.offline.trace_summary import main as trace_main

    golden = GOLDEN[0] if GOLDEN else None
    if golden is None:
        pytest.skip("no golden trace")
    png = tmp_path / "t.png"
    assert trace_main(["summary", str(golden), "--phases", "4", "--png", str(png), "--allow-schema-drift"]) == 0
    out = capsys.readouterr().out
    assert "mean B" in out and len(out.splitlines()) >= 7 and png.stat().st_size > 1000


def test_trace_summary_by_gamma_accounts_for_every_decode_step_and_its_period():
    from nightjar.kernel.trace import read_trace
    from nightjar.offline.trace_summary import gamma_rows, load_timeline

    path = Path(__file__).parent / "replay" / "tiny_nightjar.njtrace"
    rows = gamma_rows(load_timeline(str(path)))
    _, envs, _ = read_trace(path)
    timed = [e.msg for e in envs if isinstance(e.msg, StepTimed) and e.msg.batch_size and not e.msg.num_prefill_tokens]
    sched = {e.msg.step: e.t for e in envs if isinstance(e.msg, StepScheduled)}
    rows_of = {e.msg.step: e.msg.req_ids for e in envs if isinstance(e.msg, StepScheduled)}
    decode_of = {e.msg.step: set(e.msg.req_ids[:e.msg.num_decode]) for e in envs if isinstance(e.msg, StepScheduled)}
    assert {r["gamma"]: r["steps"] for r in rows} == dict(Counter(s.gamma for s in timed))
    assert len(rows) >= 2                                            # the planner played more than one γ
    for r in rows:
        ss = [s for s in timed if s.gamma == r["gamma"]]
        assert r["tok_step"] == pytest.approx(sum(s.tokens_emitted for s in ss) / len(ss))
        took = {s.step: sched[s.step + 1] - sched[s.step] - s.catchup_time_s for s in ss if s.step + 1 in sched}
        follow = [s for s in ss if s.step in took and decode_of[s.step] & set(rows_of[s.step + 1])
                  and took[s.step] <= 3 * s.step_time_s + 0.02]
        if follow:                                                   # period: one StepScheduled to the next
            per = sum(took[s.step] for s in follow)
            assert r["period_ms_tok"] == pytest.approx(1e3 * per / sum(s.tokens_emitted for s in follow))
            assert r["period_ms_tok"] * r["tok_step"] > 0.5 * r["step_ms"]     # a period holds its step


def test_trace_summary_leaves_idle_gaps_and_new_rows_out_of_periods():
    """A step after which the engine idled (the next step came 2 s later) or whose rows all finished is not a
    period: at low load those gaps would swamp the per-token figure."""
    from nightjar.offline.trace_summary import Timeline, gamma_rows

    tl = Timeline()
    timed = []
    for step, (t, rows) in enumerate([(0.0, (1,)), (0.02, (1,)), (0.04, (1,)), (2.04, (2,)), (2.06, (2,))]):
        tl.scheduled[step] = t
        tl.rows[step] = (frozenset(rows), rows)
        timed.append(StepTimed(step=step, batch_size=1, gamma=2, step_time_s=0.015, tokens_emitted=2))
    tl.steps = [(tl.scheduled[s.step] + 0.015, s) for s in timed]
    row, = gamma_rows(tl)
    assert row["steps"] == 5                          # every step counts for tokens and step time ...
    assert row["period_ms_tok"] == pytest.approx(10.0)    # ... only steps 0, 1 and 3 for the period: 20 ms / 2


def test_trace_summary_by_batch_compares_gammas_at_one_batch_size():
    """Per (B, γ): tokens a row and period per token over the steps the next one follows on from."""
    from nightjar.offline.trace_summary import Timeline, batch_rows

    tl = Timeline()
    plan = [(1, 2, 3), (1, 2, 3), (2, 4, 8), (2, 4, 6), (2, 0, 2), (2, 0, 2)]     # (B, γ, tokens) per step
    t = 0.0
    for step, (b, g, tok) in enumerate(plan + [(2, 0, 2)]):
        rows = tuple(range(b))
        tl.scheduled[step] = t
        tl.rows[step] = (frozenset(rows), rows)
        if step < len(plan):
            tl.steps.append((t, StepTimed(step=step, batch_size=b, gamma=g, step_time_s=0.01, tokens_emitted=tok)))
        t += 0.012
    got = {(r["batch"], r["gamma"]): r for r in batch_rows(tl)}
    assert set(got) == {(1, 2), (2, 4), (2, 0)}
    assert got[(2, 4)]["steps"] == 2 and got[(2, 4)]["tok_row"] == pytest.approx(3.5)       # (8 + 6) / (2 rows · 2)
    assert got[(2, 4)]["period_ms_tok"] == pytest.approx(24.0 / 14)
    assert got[(2, 0)]["period_ms_tok"] == pytest.approx(6.0)
    assert [r["gamma"] for r in batch_rows(tl, min_steps=3)] == []


def test_trace_summary_prints_the_by_batch_table_and_refuses_a_bad_min_steps_or_phases(capsys):
    from nightjar.offline.trace_summary import main as trace_main

    path = Path(__file__).parent / "replay" / "tiny_nightjar.njtrace"
    assert trace_main(["summary", str(path), "--phases", "2", "--by-batch", "--min-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "by batch size and γ" in out and "tok/row" in out
    with pytest.raises(SystemExit) as e:
        trace_main(["summary", str(path), "--by-batch", "--min-steps", "0"])
    assert e.value.code == 2 and "must be > 0: '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:                        # no windows: an empty table before, now a usage error
        trace_main(["summary", str(path), "--phases", "0"])
    assert e.value.code == 2 and "--phases: must be > 0: '0'" in capsys.readouterr().err


def test_trace_summary_prints_the_by_gamma_table(capsys):
    from nightjar.offline.trace_summary import main as trace_main

    path = Path(__file__).parent / "replay" / "tiny_nightjar.njtrace"
    assert trace_main(["summary", str(path), "--phases", "2", "--by-gamma"]) == 0
    out = capsys.readouterr().out
    assert "by γ, decode steps without prefill" in out and "period ms/tok" in out
