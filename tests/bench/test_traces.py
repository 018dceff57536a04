"""Trace files: the shipped ones load and make sense; bad files give clear errors; the CLI reports them."""
from __future__ import annotations

import json

import pytest

from nightjar.bench.cli import main
from nightjar.offline.arrivals import TRACE_DIR, TraceError, load_trace, parse_trace

SHIPPED = ["phased_low_surge_low", "spike", "oscillation", "worst_case", "azure_like_diurnal"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_traces(name):
    t = load_trace(TRACE_DIR / f"{name}.json")
    assert 60 <= t.duration_s <= 600 and t.expected_requests() > 20
    assert t.name == name and t.description
    assert load_trace(name).phases == t.phases                 # by name


def test_shipped_shapes():
    spike = [p.extra["paper_rate"] for p in load_trace("spike").phases]
    assert spike == [2, 8, 24, 40, 6]
    osc = load_trace("oscillation").phases
    assert [p.kind for p in osc] == ["low", "high"] * 3
    wc = load_trace("worst_case").phases
    assert [p.extra["paper_rate"] for p in wc] == [6, 36, 36, 3, 30]
    assert min(p.burstiness for p in wc) == 0.35 and max(p.burstiness for p in wc) == 1.3
    ph = load_trace("phased_low_surge_low").phases
    assert ph[1].rate > 5 * ph[0].rate and ph[0].rate == ph[2].rate


def test_extra_keys_kept():
    t = parse_trace({"phases": [{"duration_s": 5, "rate": 1, "kind": "spike", "note": "x"}], "scaling": 2})
    assert t.phases[0].kind == "spike" and t.phases[0].extra == {"note": "x"} and t.meta == {"scaling": 2}
    assert t.phases[0].burstiness == 1.0 and t.to_dict()["phases"][0]["note"] == "x"
    assert parse_trace([{"duration_s": 1, "rate": 0}]).duration_s == 1       # a bare list of phases


@pytest.mark.parametrize("obj,msg", [
    ("nope", "JSON object"),
    ({}, "missing the 'phases' key"),
    ({"phases": []}, "non-empty list"),
    ({"phases": [3]}, "phase 0: must be an object"),
    ({"phases": [{"rate": 1}]}, "phase 0: missing 'duration_s'"),
    ({"phases": [{"duration_s": 1, "rate": 1}, {"duration_s": 1}]}, "phase 1: missing 'rate'"),
    ({"phases": [{"duration_s": 0, "rate": 1}]}, "'duration_s' must be a finite number > 0"),
    ({"phases": [{"duration_s": 5, "rate": -1}]}, "'rate' must be a finite number >= 0"),
    ({"phases": [{"duration_s": 5, "rate": "fast"}]}, "'rate' must be a number"),
    ({"phases": [{"duration_s": 5, "rate": 1e999}]}, "'rate' must be a finite"),
    ({"phases": [{"duration_s": 5, "rate": 1, "burstiness": 0}]}, "'burstiness' must be a finite number > 0"),
    ({"phases": [{"duration_s": 5, "rate": True}]}, "'rate' must be a number"),
    ({"phases": [{"duration_s": 5, "rate": 1, "kind": 3}]}, "'kind' must be a string"),
])
def test_bad_traces(obj, msg):
    with pytest.raises(TraceError, match=msg) as e:
        parse_trace(obj, "my.json")
    assert str(e.value).startswith("my.json")


def test_bad_files(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text('{"phases": [\n  {"duration_s": 1,, "rate": 1}]}')
    with pytest.raises(TraceError, match=r"bad.json: invalid JSON at line 2 column"):
        load_trace(p)
    with pytest.raises(TraceError, match="no such trace file.*spike"):
        load_trace(tmp_path / "missing.json")


def test_cli_reports_trace_errors(tmp_path, capsys):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"phases": [{"duration_s": 5, "rate": -2}]}))
    assert main(["serve", "--trace", str(p), "--tokenizer", "words", "--disable-tqdm"]) == 2
    assert "phase 0: 'rate'" in capsys.readouterr().err
    assert main(["serve", "--goodput", "latency:5", "--tokenizer", "words"]) == 2
    assert main(["trace-info", "spike", "--trace-rate-scale", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 3 | spike |" in out and "2.4" in out
