"""Dataset shapes: output/input length statistics, splits, random and custom prompts, determinism."""
from __future__ import annotations

import json

import numpy as np
import pytest

from nightjar.bench.datasets import SPECS, DatasetError, LengthDist, build_requests, choose_split
from nightjar.data import load_prompts


def test_lognormal_by_median_and_p90():
    d = LengthDist(200, 700, 1, 10**6)
    x = d.sample(np.random.default_rng(0), 40_000)
    assert np.median(x) == pytest.approx(200, rel=0.03)
    assert np.percentile(x, 90) == pytest.approx(700, rel=0.04)
    assert x.mean() == pytest.approx(d.mean, rel=0.04)


@pytest.mark.parametrize("name", ["sharegpt-like", "alpaca-like", "specbench-like"])
def test_output_lengths_follow_the_target(name):
    reqs, info = build_requests(name, 2000, seed=1, tokenizer=None, max_total_len=None)
    out = np.asarray([r.max_tokens for r in reqs])
    spec = SPECS[name].output
    assert out.min() >= spec.lo and out.max() <= spec.hi
    assert np.median(out) == pytest.approx(spec.median, rel=0.08)
    assert np.percentile(out, 90) == pytest.approx(min(spec.p90, spec.hi), rel=0.10)
    assert info["max_tokens"]["median"] == float(np.median(out))


def test_input_shapes():
    share, _ = build_requests("sharegpt-like", 1500, seed=2, tokenizer=None, max_total_len=None)
    alpaca, _ = build_requests("alpaca-like", 1500, seed=2, tokenizer=None, max_total_len=None)
    s = np.asarray([r.prompt_len for r in share])
    a = np.asarray([r.prompt_len for r in alpaca])
    # ShareGPT-like inputs are several times longer than Alpaca-like ones (vLLM paper: ~8x on average)
    assert np.median(s) == pytest.approx(SPECS["sharegpt-like"].input.median, rel=0.3)
    assert np.median(a) == pytest.approx(SPECS["alpaca-like"].input.median, rel=0.3)
    assert s.mean() > 4 * a.mean()
    assert any(r.prompt.startswith("Answer each of the following") for r in share)   # long targets: multi-part


def test_specbench_equal_shares():
    reqs, _ = build_requests("specbench-like", 480, seed=0, tokenizer=None)
    cats = [r.category for r in reqs]
    assert sorted(set(cats)) == sorted(SPECS["specbench-like"].weights)
    assert all(cats.count(c) == 80 for c in set(cats))


def test_native_prompts_and_split_rule():
    held = load_prompts(split="heldout")
    assert choose_split("auto", len(held)) == ("heldout", "heldout")
    assert choose_split("auto", len(held) + 1) == (None, "all")
    reqs, info = build_requests("prompts", 40, seed=0, tokenizer=None)
    assert info["split"] == "heldout" and len({r.prompt for r in reqs}) == 40      # no repeats within a pass
    ids = {p["prompt"]: p["max_tokens"] for p in held}
    assert all(ids[r.prompt] == r.max_tokens for r in reqs)
    _, info = build_requests("prompts", 300, seed=0, tokenizer=None)
    assert info["split"] == "all"


def test_deterministic_in_seed():
    a, _ = build_requests("sharegpt-like", 50, seed=9, tokenizer=None)
    b, _ = build_requests("sharegpt-like", 50, seed=9, tokenizer=None)
    c, _ = build_requests("sharegpt-like", 50, seed=10, tokenizer=None)
    assert a == b and a != c


def test_random_token_counts(smol_tokenizer):
    reqs, info = build_requests("random", 20, seed=0, tokenizer=smol_tokenizer, random_input_len=64,
                                random_output_len=32, random_range_ratio=0.25)
    for r in reqs:
        assert 24 <= r.max_tokens <= 40
        assert abs(len(smol_tokenizer.encode(r.prompt)) - r.prompt_len) == 0
        assert 48 - 2 <= r.prompt_len <= 80 + 2
    assert info["random_input_len"] == 64


def test_output_len_override_and_clamp():
    reqs, info = build_requests("alpaca-like", 20, seed=0, tokenizer=None, output_len=7)
    assert {r.max_tokens for r in reqs} == {7}
    reqs, info = build_requests("sharegpt-like", 300, seed=0, tokenizer=None, max_total_len=300)
    assert all(r.prompt_len + r.max_tokens <= 300 or r.max_tokens == 1 for r in reqs)
    assert info["max_tokens_clamped"] > 0


def test_custom_jsonl(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps({"prompt": "Hello there", "max_tokens": 9}) + "\n\n" + json.dumps({"prompt": "Bye"}) + "\n")
    reqs, info = build_requests("custom", 5, dataset_path=str(p), tokenizer=None)
    assert [r.prompt for r in reqs] == ["Hello there", "Bye"] * 2 + ["Hello there"]
    assert [r.max_tokens for r in reqs[:2]] == [9, 128] and reqs[1].source == "custom:3"
    for text, msg in [("{nope\n", "c.jsonl:1: invalid JSON"), ('{"text": "x"}\n', "expected"),
                      ('{"prompt": "x", "max_tokens": 0}\n', "max_tokens"), ("\n", "no prompts")]:
        p.write_text(text)
        with pytest.raises(DatasetError, match=msg):
            build_requests("custom", 1, dataset_path=str(p), tokenizer=None)
    with pytest.raises(DatasetError, match="dataset-path"):
        build_requests("custom", 1, tokenizer=None)
    with pytest.raises(DatasetError, match="unknown dataset"):
        build_requests("sharegpt", 1, tokenizer=None)
