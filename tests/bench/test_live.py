"""A short benchmark against a LIVE in-process server on the tiny model: JSON + PNG; compare's dry path."""
from __future__ import annotations

import json

import pytest

from nightjar.bench.compare import markdown_compare, run_compare
from nightjar.bench.report import markdown_summary, plot_result, write_json
from nightjar.bench.runner import BenchOptions, prepare, run_prepared
from nightjar.bench.server import InProcessServer


def _opts(**kw) -> BenchOptions:
    base = dict(dataset_name="alpaca-like", num_prompts=8, request_rate=40.0, seed=3, output_len=12,
                ignore_eos=True, tokenizer=None, max_total_len=400, timeline_interval_s=0.25, progress=False,
                goodput={"ttft": 60_000.0, "e2el": 60_000.0}, save_detailed=True)
    base.update(kw)
    return BenchOptions(**base)


def test_live_bench_json_and_png(tiny_engine_factory, smol_tokenizer, tmp_path):
    opts = _opts()
    prep = prepare(opts, tokenizer=smol_tokenizer)
    with InProcessServer(tiny_engine_factory("fixed:2"), "nightjar-tiny") as srv:
        res = run_prepared(opts, prep, srv.base_url, extra={"policy": "fixed:2"})
    assert res["completed"] == 8 and res["failed"] == 0, res["errors"]
    # ignore_eos + max_tokens=12: the usage chunk must report exactly 12 tokens per request
    assert res["total_output_tokens"] == 8 * 12
    for r in res["requests"]:
        assert r["output_tokens"] == 12 and r["ttft_ms"] > 0 and r["e2e_ms"] >= r["ttft_ms"]
        assert r["num_chunks"] >= 1 and len(r["itl_ms"]) == r["num_chunks"] - 1
    assert res["output_throughput"] > 0 and res["mean_tpot_ms"] is not None
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    # the /metrics poller saw the server; speculation ran with γ=2
    assert res["server"]["num_scrapes"] >= 2
    spec = res["server"]["spec_decode"]
    assert spec["num_draft_tokens"] > 0 and spec["mean_gamma"] == pytest.approx(2.0, abs=0.5)
    assert "running" in res["timeline"] and "kv_blocks_free" in res["timeline"]
    path = write_json(res, tmp_path / "r.json")
    back = json.loads(path.read_text())
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
                "timeline", "arrivals", "dataset", "requests", "machine", "config"):
        assert key in back
    png = plot_result(back, tmp_path / "r.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "Output token throughput" in markdown_summary(back)


def test_compare_dry_in_process(tiny_engine_factory, tmp_path):
    opts = _opts(num_prompts=6, goodput={}, num_warmups=1)
    summary = run_compare(opts, ["off", "fixed:2"], lambda pol: InProcessServer(lambda: tiny_engine_factory(pol), "t"),
                          repeats=1, runs_dir=tmp_path / "runs", mode="in-process", log=lambda s: None)
    assert summary["orders"] == [["off", "fixed:2"]]
    for pol in ("off", "fixed:2"):
        s = summary["policies"][pol]
        assert s["num_ok"] == 1 and s["output_throughput"] > 0 and s["mean_ttft_ms"] > 0 and s["mean_e2e_ms"] > 0
        assert s["runs"][0]["failed"] == 0
    assert summary["policies"]["off"]["mean_gamma"] in (None, 0.0)
    r = summary["ratios"]["vs_off"]["fixed:2"]["output_throughput"]
    assert r["median"] > 0 and r["n"] == 1
    assert summary["ratios"]["vs_best_fixed"]["reference"]["output_throughput"] == "fixed:2"
    assert summary["arrivals"]["fingerprint"] and summary["arrivals"]["requests_fingerprint"]
    assert (tmp_path / "runs" / "off_rep1.json").exists()
    write_json(summary, tmp_path / "c.json")
    assert "Ratio to off" in markdown_compare(summary)


def test_cli_serve_against_live_server(tiny_engine_factory, tmp_path, capsys):
    from nightjar.bench.cli import main

    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"phases": [{"duration_s": 0.6, "rate": 10, "kind": "a"},
                                            {"duration_s": 0.6, "rate": 0, "kind": "idle"}]}))
    with InProcessServer(tiny_engine_factory("off"), "nightjar-tiny") as srv:
        rc = main(["serve", "--base-url", srv.base_url + "/v1", "--trace", str(trace), "--dataset-name", "random",
                   "--random-input-len", "16", "--random-output-len", "6", "--ignore-eos", "--tokenizer", "words",
                   "--endpoint-type", "completions", "--timeline-interval", "0.2", "--disable-tqdm",
                   "--goodput", "ttft:60000", "--metric-percentiles", "50,90,99",
                   "--output-json", str(tmp_path / "o.json"), "--plot", str(tmp_path / "o.png")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| Output token throughput (tok/s) |" in out and "| TTFT |" in out and "| 1 | idle |" in out
    res = json.loads((tmp_path / "o.json").read_text())
    assert res["model"] == "nightjar-tiny" and res["failed"] == 0 and res["completed"] >= 1
    assert res["total_output_tokens"] == 6 * res["completed"] and "p90_ttft_ms" in res
    assert res["arrivals"]["mode"] == "trace" and [p["kind"] for p in res["per_phase"]] == ["a", "idle"]
    assert (tmp_path / "o.png").stat().st_size > 10_000
