"""Metrics from hand-built request events match hand-computed values."""
from __future__ import annotations

import pytest

from nightjar.bench.metrics import (
    RequestResult,
    Sample,
    build_timeline,
    compute_metrics,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    parse_prometheus,
    pick_series,
    spec_summary,
)


def _results():
    a = RequestResult(0, start_s=0.0, success=True, ttft_s=0.100, e2e_s=0.180, chunk_s=[0.100, 0.140, 0.180],
                      output_tokens=5, prompt_tokens=10)      # 5 tokens in 3 chunks: ITL 40, 40; TPOT 20
    b = RequestResult(1, start_s=0.5, success=True, ttft_s=0.200, e2e_s=0.500, chunk_s=[0.200, 0.500],
                      output_tokens=2, prompt_tokens=20)      # TPOT 300, ITL 300
    c = RequestResult(2, start_s=1.0, success=True, ttft_s=0.050, e2e_s=0.050, chunk_s=[0.050],
                      output_tokens=1, prompt_tokens=30)      # one token: no TPOT
    d = RequestResult(3, start_s=1.2, success=False, status=429, error="HTTP 429: busy")
    return [a, b, c, d]


def test_per_request_definitions():
    a, b, c, _ = _results()
    assert a.tpot_s == pytest.approx(0.020) and a.itl_s == pytest.approx([0.040, 0.040])
    assert b.tpot_s == pytest.approx(0.300) and c.tpot_s is None and c.itl_s == []


def test_summary_matches_hand_computation():
    m = compute_metrics(_results(), 2.0, percentiles=[50, 90, 99])
    assert (m["completed"], m["failed"], m["rejected_429"]) == (3, 1, 1)
    assert m["total_output_tokens"] == 8 and m["total_input_tokens"] == 60
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(34.0)
    # TTFT [100, 200, 50]: linear-interpolated percentiles on the sorted [50, 100, 200]
    assert m["mean_ttft_ms"] == pytest.approx(350 / 3)
    assert m["median_ttft_ms"] == pytest.approx(100)
    assert m["p90_ttft_ms"] == pytest.approx(100 + 0.8 * 100)
    assert m["p99_ttft_ms"] == pytest.approx(100 + 0.98 * 100)
    assert m["mean_tpot_ms"] == pytest.approx(160) and m["median_tpot_ms"] == pytest.approx(160)
    assert m["p99_tpot_ms"] == pytest.approx(20 + 0.99 * 280)
    assert m["mean_itl_ms"] == pytest.approx(380 / 3) and m["median_itl_ms"] == pytest.approx(40)
    assert m["mean_e2el_ms"] == pytest.approx(730 / 3) and m["median_e2el_ms"] == pytest.approx(180)
    assert m["p50_e2el_ms"] == m["median_e2el_ms"]
    assert m["request_goodput"] is None


@pytest.mark.parametrize("slo,good", [
    ({"ttft": 150}, 2),                 # b misses (200 ms)
    ({"ttft": 150, "tpot": 25}, 2),     # c has no TPOT: meets it
    ({"tpot": 10}, 1),                  # only c
    ({"e2el": 100}, 1),                 # only c
    ({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 3),
])
def test_goodput(slo, good):
    m = compute_metrics(_results(), 2.0, slo=slo)
    assert m["good_requests"] == good and m["request_goodput"] == pytest.approx(good / 2.0)


def test_usage_missing_is_not_counted_from_chunks():
    r = RequestResult(0, success=True, ttft_s=0.1, e2e_s=0.3, chunk_s=[0.1, 0.2, 0.3], output_tokens=None,
                      usage_source="none")
    m = compute_metrics([r], 1.0)
    assert m["total_output_tokens"] == 0 and m["requests_without_usage"] == 1 and m["mean_tpot_ms"] is None


def test_empty_run():
    m = compute_metrics([], 0.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] is None and m["request_throughput"] is None


def test_option_parsing():
    assert parse_goodput(["ttft:500", "tpot:50", "e2e:9000"]) == {"ttft": 500, "tpot": 50, "e2el": 9000}
    for bad in (["foo:1"], ["ttft"], ["ttft:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert parse_percentiles("50,99.9") == [50.0, 99.9]
    with pytest.raises(ValueError):
        parse_percentiles("101")
    assert parse_metric_names("ttft,e2el,e2e") == ["ttft", "e2el", "e2el"]
    with pytest.raises(ValueError):
        parse_metric_names("ttft,latency")


PROM = """# HELP nightjar:num_requests_running Requests in the running batch.
# TYPE nightjar:num_requests_running gauge
nightjar:num_requests_running 3.0
nightjar:num_requests_waiting 1.0
nightjar:kv_blocks_free 200.0
nightjar:spec_gamma_bucket{le="1.0"} 4.0
nightjar:spec_gamma_sum 30.0
nightjar:spec_gamma_count 10.0
nightjar:spec_decode_num_drafts_total 40.0
nightjar:spec_decode_num_draft_tokens_total 120.0
nightjar:spec_decode_num_accepted_tokens_total 60.0
nightjar:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 30.0
nightjar:generation_tokens_total 500.0
nightjar:draft_resident 1.0
"""


def test_prometheus_parsing_and_series():
    flat = parse_prometheus(PROM)
    assert flat['nightjar:spec_gamma_bucket{le="1.0"}'] == 4.0
    s = pick_series(flat)
    assert s["running"] == 3 and s["gamma_sum"] == 30 and s["accepted"] == 60 and s["gen_tokens"] == 500
    assert pick_series(parse_prometheus("vllm:num_requests_running 7\n"))["running"] == 7


def test_timeline_and_spec_summary():
    z = {"gamma_sum": 0.0, "gamma_count": 0.0, "gen_tokens": 0.0, "draft_tokens": 0.0, "accepted": 0.0,
         "drafts": 0.0}
    s0 = Sample(0.0, dict(z, running=0.0))
    s1 = Sample(1.0, {"gamma_sum": 30.0, "gamma_count": 10.0, "gen_tokens": 100.0, "draft_tokens": 90.0,
                      "accepted": 45.0, "drafts": 30.0, "running": 4.0, "kv_free": 50.0})
    s2 = Sample(2.0, {"gamma_sum": 40.0, "gamma_count": 20.0, "gen_tokens": 150.0, "draft_tokens": 100.0,
                      "accepted": 55.0, "drafts": 35.0, "running": 2.0, "kv_free": 70.0})
    r = RequestResult(0, start_s=0.2, success=True, ttft_s=0.3, e2e_s=1.5, chunk_s=[0.3, 0.9, 1.5],
                      output_tokens=6)
    tl = build_timeline([r], [s0, s1, s2], 2.5, 1.0, phase_bounds=[0.0, 1.5, 3.0])
    assert tl["t"] == [0.0, 1.0, 2.0]
    # chunks at 0.5, 1.1, 1.7 carry 2 tokens each
    assert tl["output_tokens_per_s"] == pytest.approx([2.0, 4.0, 0.0])
    assert tl["arrivals_per_s"] == [1.0, 0.0, 0.0] and tl["completions_per_s"] == [0.0, 1.0, 0.0]
    assert tl["server_tokens_per_s"] == [100.0, 50.0, None]       # pairs (0,1) -> [0,1), (1,2) -> [1,2)
    assert tl["gamma_mean"] == [3.0, 1.0, None]
    assert tl["acceptance_rate"] == [0.5, 1.0, None]
    assert tl["running"] == [0.0, 4.0, 2.0] and tl["kv_blocks_free"] == [None, 50.0, 70.0]
    assert tl["phase"] == [0, 0, 1]
    sp = spec_summary(s0, s2)
    assert sp["acceptance_rate"] == pytest.approx(0.55) and sp["mean_acceptance_length"] == pytest.approx(1 + 55 / 35)
    assert sp["mean_gamma"] == pytest.approx(2.0)


def test_load_summary_takes_peak_and_mean_batch_and_the_largest_pool():
    from nightjar.bench.metrics import Sample, load_summary

    samples = [Sample(0.0, {"running": 2, "kv_total": 700}), Sample(1.0, {"running": 9}),
               Sample(2.0, {"running": 4, "kv_total": 760}), Sample(3.0, {})]
    assert load_summary(samples) == {"max_running": 9, "mean_running": 5.0, "max_kv_blocks_total": 760,
                                     "min_kv_blocks_total": 700}
    assert load_summary([])["max_running"] is None
