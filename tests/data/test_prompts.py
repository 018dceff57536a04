"""Sanity checks for the bundled prompt collection (nightjar/data)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest

try:  # allow running this file directly before a rootdir conftest exists
    import nightjar.data  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nightjar.data import CATEGORIES, SPLITS, load_prompts

REQUIRED_KEYS = {"id", "category", "prompt", "split", "max_tokens"}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return load_prompts()


def test_jsonl_parses_line_by_line():
    text = resources.files("nightjar.data").joinpath("prompts.jsonl").read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) >= 560
    for ln in lines:
        obj = json.loads(ln)
        assert set(obj) == REQUIRED_KEYS


def test_record_schema(rows):
    for r in rows:
        assert set(r) == REQUIRED_KEYS, r.get("id")
        assert r["category"] in CATEGORIES
        assert r["split"] in SPLITS
        assert r["id"].startswith(r["category"] + "-")
        assert isinstance(r["prompt"], str) and r["prompt"].strip() == r["prompt"] and r["prompt"]
        assert isinstance(r["max_tokens"], int) and 16 <= r["max_tokens"] <= 512


def test_ids_unique(rows):
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids))


def test_total_and_per_category_counts(rows):
    assert len(rows) >= 560
    counts = Counter(r["category"] for r in rows)
    assert set(counts) == set(CATEGORIES)
    for cat in CATEGORIES:
        assert counts[cat] >= 60, (cat, counts[cat])


def test_heldout_fraction_per_category(rows):
    for cat in CATEGORIES:
        rs = [r for r in rows if r["category"] == cat]
        frac = sum(r["split"] == "heldout" for r in rs) / len(rs)
        assert 0.08 <= frac <= 0.16, (cat, frac)


def test_no_exact_duplicate_prompts(rows):
    dupes = [p for p, n in Counter(r["prompt"] for r in rows).items() if n > 1]
    assert not dupes


def test_no_prompt_in_both_splits(rows):
    norm = lambda s: " ".join(s.lower().split())  # noqa: E731
    train = {norm(r["prompt"]) for r in rows if r["split"] == "train"}
    heldout = {norm(r["prompt"]) for r in rows if r["split"] == "heldout"}
    assert not (train & heldout)


def test_lengths_are_varied(rows):
    words = [len(r["prompt"].split()) for r in rows]
    long_frac = sum(w >= 60 for w in words) / len(words)
    assert 0.12 <= long_frac <= 0.35, long_frac
    budgets = {r["max_tokens"] for r in rows}
    assert len(budgets) >= 5


def test_load_prompts_filters(rows):
    train = load_prompts(split="train")
    heldout = load_prompts(split="heldout")
    assert train and heldout
    assert all(r["split"] == "train" for r in train)
    assert all(r["split"] == "heldout" for r in heldout)
    assert len(train) + len(heldout) == len(rows)

    total = 0
    for cat in CATEGORIES:
        sub = load_prompts(category=cat)
        assert sub and all(r["category"] == cat for r in sub)
        both = load_prompts(split="heldout", category=cat)
        assert both and all(r["category"] == cat and r["split"] == "heldout" for r in both)
        total += len(sub)
    assert total == len(rows)


def test_load_prompts_returns_copies():
    a = load_prompts(category="math")
    a[0]["prompt"] = "mutated"
    assert load_prompts(category="math")[0]["prompt"] != "mutated"


@pytest.mark.parametrize("kwargs", [{"split": "test"}, {"category": "poetry"}])
def test_load_prompts_rejects_unknown(kwargs):
    with pytest.raises(ValueError):
        load_prompts(**kwargs)


def test_training_prompts_add_an_extra_train_only_collection(rows):
    from difflib import SequenceMatcher

    from nightjar.data import training_prompts

    train = training_prompts()
    extra = train[len(load_prompts(split="train")):]
    assert len(extra) >= 400 and all(r["split"] == "train" for r in extra)
    for r in extra:
        assert set(r) == REQUIRED_KEYS and r["category"] in CATEGORIES and r["id"].startswith(r["category"] + "-")
        assert r["prompt"].strip() == r["prompt"] and 16 <= r["max_tokens"] <= 512
    assert len({r["id"] for r in rows + extra}) == len(rows) + len(extra)
    assert len({r["prompt"] for r in rows + extra}) == len(rows) + len(extra)
    assert min(Counter(r["category"] for r in extra).values()) >= 40
    # Benchmarks score the held-out split: no extra prompt may be a near copy of one.
    norm = lambda s: " ".join(s.lower().split())  # noqa: E731
    held = [norm(r["prompt"]) for r in rows if r["split"] == "heldout"]
    for r in extra:
        p = norm(r["prompt"])
        close = [h for h in held if SequenceMatcher(None, p, h).quick_ratio() > 0.8
                 and SequenceMatcher(None, p, h).ratio() > 0.8]
        assert not close, (r["id"], close)
