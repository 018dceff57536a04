"""Bundled prompt collection for draft-model distillation and benchmarks.

The prompts live in ``prompts.jsonl`` next to this module (package data) and
were written by hand for Nightjar. Each record is a dict with the keys
``id``, ``category``, ``prompt``, ``split`` ("train" or "heldout") and
``max_tokens`` (suggested response budget).

    >>> from nightjar.data import load_prompts
    >>> bench = load_prompts(split="heldout")
    >>> code = load_prompts(category="code")

``prompts_extra.jsonl`` holds more hand-written prompts of the same shape for draft training only
(every record ``split: "train"``); :func:`training_prompts` returns them after the train split above.
Benchmarks use :func:`load_prompts`, whose held-out split they never touch.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

__all__ = ["CATEGORIES", "SPLITS", "PROMPT_FILES", "EXTRA_TRAIN_FILE", "load_prompts", "training_prompts"]

CATEGORIES: tuple[str, ...] = (
    "chat",
    "code",
    "qa",
    "math",
    "summarization",
    "translation",
    "extraction",
    "writing",
)
SPLITS: tuple[str, ...] = ("train", "heldout")
PROMPT_FILES: tuple[str, ...] = ("prompts.jsonl",)
EXTRA_TRAIN_FILE = "prompts_extra.jsonl"


@lru_cache(maxsize=None)
def _load_all(names: tuple[str, ...] = PROMPT_FILES) -> tuple[dict, ...]:
    rows: list[dict] = []
    pkg = resources.files(__name__)
    for name in names:
        text = pkg.joinpath(name).read_text(encoding="utf-8")
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:  # pragma: no cover - data bug
                raise ValueError(f"{name}:{lineno}: invalid JSON: {exc}") from exc
    return tuple(rows)


def load_prompts(split: str | None = None, category: str | None = None) -> list[dict]:
    """Return prompt records, optionally filtered by ``split`` and ``category``.

    Records are returned in file order as fresh dict copies, so callers may
    mutate them freely. Unknown split/category names raise ``ValueError``.
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")
    return [
        dict(r)
        for r in _load_all()
        if (split is None or r["split"] == split)
        and (category is None or r["category"] == category)
    ]


def training_prompts() -> list[dict]:
    """Every hand-written prompt draft training may use: the train split of :func:`load_prompts`, then
    the training-only extra collection (fresh dict copies)."""
    return load_prompts(split="train") + [dict(r) for r in _load_all((EXTRA_TRAIN_FILE,))]
