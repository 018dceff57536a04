"""Benchmark prompt sets, built offline from :func:`nightjar.data.load_prompts` (no downloads).

Names (``--dataset-name``):

=================  ===============================================================================================
``prompts``        the bundled prompts as written, with their own ``max_tokens`` (48–256, median 96, p90 160).
``sharegpt-like``  ShareGPT's shape (vLLM paper: inputs ≈ 8× and outputs ≈ 6× Alpaca's). Targets, in tokens of the
                   user text: input lognormal median 110 / p90 420, clipped to [4, 1024]; output ``max_tokens``
                   lognormal median 200 / p90 700 (mean ≈ 320), clipped to [8, 1024]. Chat/writing/code heavy.
``alpaca-like``    Alpaca's shape (mean input ≈ 19, output ≈ 58 tokens): input median 16 / p90 40, clipped to
                   [4, 256]; output median 48 / p90 120 (mean ≈ 62), clipped to [8, 512]. All categories equally.
``specbench-like`` Spec-Bench's mix: six task families in equal shares (multi-turn chat, translation,
                   summarization, QA, math reasoning, RAG -> ``extraction``: a passage plus a question), their
                   natural inputs, output median 128 / p90 256, clipped to [16, 512].
``random``         ``--random-input-len`` tokens of words from the prompt corpus, ``--random-output-len`` outputs,
                   both uniform in ``[L·(1-r), L·(1+r)]`` with ``r = --random-range-ratio``.
``custom``         ``--dataset-path FILE.jsonl``: one ``{"prompt": str, "max_tokens": int (optional)}`` per line.
=================  ===============================================================================================

A lognormal with median ``m`` and 90th percentile ``q`` has σ = ln(q/m)/1.2816. Input shaping: for each request a
target length is drawn; a category is drawn by weight; the prompt of that category nearest in length is taken
(random among the 3 nearest); while the text is still short of 85 % of the target, the nearest prompt to the
remainder is appended as a numbered sub-task (at most 12 parts, no prompt twice). Lengths are counted with the target
model's
tokenizer when one is given, else estimated as 1.3 tokens per word. Lengths exclude the chat template.

Split (``--split auto``): the ``heldout`` split when it has at least as many prompts as the run needs (73
prompts), else all 615 prompts. Drafts distilled on the ``train`` split accept more on train prompts; use
``--split heldout`` (prompts then repeat) when that matters.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from nightjar.data import CATEGORIES, load_prompts

DATASETS = ("prompts", "sharegpt-like", "alpaca-like", "specbench-like", "random", "custom")
Z90 = 1.2815515655446004
WORD_TOKENS = 1.3
_JOIN_HEAD = "Answer each of the following requests in turn.\n\n"


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class BenchRequest:
    index: int
    prompt: str               # the user message (chat) or the raw prompt (completions)
    max_tokens: int
    prompt_len: int           # tokens of ``prompt`` (tokenizer, or the 1.3 tokens/word estimate)
    category: str = ""
    source: str = ""          # prompt id(s), or "random" / "custom:<line>"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LengthDist:
    """Lognormal by median and p90, rounded and clipped to ``[lo, hi]``."""
    median: float
    p90: float
    lo: int
    hi: int

    @property
    def sigma(self) -> float:
        return math.log(self.p90 / self.median) / Z90

    @property
    def mean(self) -> float:
        return self.median * math.exp(self.sigma ** 2 / 2)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(x), self.lo, self.hi).astype(int)

    def describe(self) -> dict[str, float]:
        return {"median": self.median, "p90": self.p90, "clip": [self.lo, self.hi], "sigma": round(self.sigma, 4)}


@dataclass(frozen=True)
class ShapeSpec:
    weights: dict[str, float]
    output: LengthDist
    input: LengthDist | None = None       # None: the category's natural prompts


SPECS: dict[str, ShapeSpec] = {
    "sharegpt-like": ShapeSpec(
        weights={"chat": 3, "writing": 2, "code": 2, "qa": 1, "math": 1, "summarization": 1, "translation": 0.5,
                 "extraction": 0.5},
        input=LengthDist(110, 420, 4, 1024), output=LengthDist(200, 700, 8, 1024)),
    "alpaca-like": ShapeSpec(weights={c: 1.0 for c in CATEGORIES},
                             input=LengthDist(16, 40, 4, 256), output=LengthDist(48, 120, 8, 512)),
    "specbench-like": ShapeSpec(
        weights={"chat": 1, "translation": 1, "summarization": 1, "qa": 1, "math": 1, "extraction": 1},
        output=LengthDist(128, 256, 16, 512)),
}


def count_tokens(text: str, tokenizer: Tokenizer | None) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(text))
    return max(1, round(WORD_TOKENS * len(text.split())))


def load_tokenizer(spec: str | None = "auto") -> Tokenizer | None:
    """``auto``: SmolLM2's tokenizer from the pulled GGUF (None if not pulled); ``words``: None (estimate);
    a path: a GGUF file or an HF tokenizer directory."""
    if spec in (None, "words", "none"):
        return None
    from nightjar.models import hub
    from nightjar.models.tokenizer import tokenizer_from_dir, tokenizer_from_gguf

    if spec == "auto":
        if not hub.is_pulled(hub.DEFAULT_MODEL):
            return None
        spec = str(hub.model_path(hub.DEFAULT_MODEL))
    p = Path(spec)
    if p.is_dir():
        return tokenizer_from_dir(p)
    from gguf import GGUFReader
    return tokenizer_from_gguf(GGUFReader(str(p)))


def choose_split(split: str, needed: int) -> tuple[str | None, str]:
    """(split passed to ``load_prompts``, split name reported)."""
    if split == "auto":
        return ("heldout", "heldout") if len(load_prompts(split="heldout")) >= needed else (None, "all")
    if split == "all":
        return None, "all"
    if split not in ("train", "heldout"):
        raise DatasetError(f"unknown split {split!r}: expected auto, all, train or heldout")
    return split, split


class _Pool:
    """Prompts of one category sorted by length, for nearest-length picks."""

    def __init__(self, rows: list[dict], tokenizer: Tokenizer | None):
        lens = [count_tokens(r["prompt"], tokenizer) for r in rows]
        order = np.argsort(lens, kind="stable")
        self.rows = [rows[i] for i in order]
        self.lens = np.asarray([lens[i] for i in order])

    def nearest(self, target: float, rng: np.random.Generator, k: int = 3, exclude=()) -> int:
        d = np.abs(self.lens - target).astype(float)
        if len(exclude) < len(d):
            d[list(exclude)] = np.inf
        cand = np.argsort(d, kind="stable")[:k]
        return int(cand[rng.integers(len(cand))])


def _shaped(name: str, n: int, rows: list[dict], rng: np.random.Generator, tokenizer: Tokenizer | None,
            output_len: int | None) -> list[BenchRequest]:
    spec = SPECS[name]
    cats = [c for c in spec.weights if any(r["category"] == c for r in rows)]
    if not cats:
        raise DatasetError(f"{name}: no prompts in categories {list(spec.weights)}")
    w = np.asarray([spec.weights[c] for c in cats], dtype=float)
    pools = {c: _Pool([r for r in rows if r["category"] == c], tokenizer) for c in cats}
    if name == "specbench-like":        # equal shares, like Spec-Bench's 80 per task: a shuffled round-robin
        picks = np.array([cats[i % len(cats)] for i in range(n)])
        rng.shuffle(picks)
    else:
        picks = rng.choice(np.asarray(cats), size=n, p=w / w.sum())
    targets = spec.input.sample(rng, n) if spec.input is not None else None
    outs = spec.output.sample(rng, n)
    out: list[BenchRequest] = []
    for i in range(n):
        pool = pools[str(picks[i])]
        if targets is None:
            j = int(rng.integers(len(pool.rows)))
            parts = [j]
        else:
            parts, total, target = [], 0, int(targets[i])
            while total < 0.85 * target and len(parts) < 12:
                j = pool.nearest(target - total, rng, exclude=parts)
                parts.append(j)
                total += int(pool.lens[j])
        if len(parts) == 1:
            text = pool.rows[parts[0]]["prompt"]
        else:
            text = _JOIN_HEAD + "\n\n".join(f"{k + 1}. {pool.rows[j]['prompt']}" for k, j in enumerate(parts))
        out.append(BenchRequest(i, text, output_len or int(outs[i]), count_tokens(text, tokenizer), str(picks[i]),
                                "+".join(pool.rows[j]["id"] for j in parts)))
    return out


def _native(n: int, rows: list[dict], rng: np.random.Generator, tokenizer: Tokenizer | None,
            output_len: int | None) -> list[BenchRequest]:
    """Seeded permutations, concatenated: no prompt repeats before all have been used."""
    idx: list[int] = []
    while len(idx) < n:
        idx += rng.permutation(len(rows)).tolist()
    out = []
    for i, j in enumerate(idx[:n]):
        r = rows[j]
        out.append(BenchRequest(i, r["prompt"], output_len or int(r["max_tokens"]),
                                count_tokens(r["prompt"], tokenizer),
                                r["category"], r["id"]))
    return out


def _random(n: int, rng: np.random.Generator, tokenizer: Tokenizer | None, input_len: int, output_len: int,
            range_ratio: float) -> list[BenchRequest]:
    if input_len < 1 or output_len < 1:
        raise DatasetError("--random-input-len and --random-output-len must be >= 1")
    if not 0 <= range_ratio < 1:
        raise DatasetError("--random-range-ratio must be in [0, 1)")
    words = sorted({w for r in load_prompts() for w in r["prompt"].split() if w.isascii()})
    vocab = np.asarray(words)

    def lens(L: int) -> np.ndarray:
        lo, hi = max(1, math.floor(L * (1 - range_ratio))), math.ceil(L * (1 + range_ratio))
        return rng.integers(lo, hi + 1, size=n)

    ins, outs = lens(input_len), lens(output_len)
    out = []
    for i in range(n):
        target = int(ins[i])
        if tokenizer is None:
            text = " ".join(rng.choice(vocab, size=max(1, round(target / WORD_TOKENS))).tolist())
        else:
            k = target + 8
            while len(ids := tokenizer.encode(" ".join(rng.choice(vocab, size=k).tolist()))) < target:
                k *= 2
            text = tokenizer.decode(ids[:target])
        out.append(BenchRequest(i, text, int(outs[i]), count_tokens(text, tokenizer), "random", "random"))
    return out


def _custom(path: str | None, n: int, tokenizer: Tokenizer | None, output_len: int | None) -> list[BenchRequest]:
    if not path:
        raise DatasetError("--dataset-name custom needs --dataset-path FILE.jsonl")
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DatasetError(f"{p}: cannot read: {e}") from None
    rows = []
    for k, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{p}:{k}: invalid JSON: {e.msg}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise DatasetError(f'{p}:{k}: expected {{"prompt": "<non-empty string>", "max_tokens": <int, optional>}}')
        mt = obj.get("max_tokens")
        if mt is not None and (isinstance(mt, bool) or not isinstance(mt, int) or mt < 1):
            raise DatasetError(f"{p}:{k}: 'max_tokens' must be an integer >= 1, got {mt!r}")
        rows.append((k, obj["prompt"], mt))
    if not rows:
        raise DatasetError(f"{p}: no prompts")
    out = []
    for i in range(n):                         # file order, cycling
        k, prompt, mt = rows[i % len(rows)]
        out.append(BenchRequest(i, prompt, output_len or mt or 128, count_tokens(prompt, tokenizer), "custom",
                                f"custom:{k}"))
    return out


def build_requests(name: str, n: int, *, seed: int = 0, tokenizer: Tokenizer | None = None, split: str = "auto",
                   output_len: int | None = None, random_input_len: int = 128, random_output_len: int = 128,
                   random_range_ratio: float = 0.0, dataset_path: str | None = None,
                   max_total_len: int | None = 2048 - 64) -> tuple[list[BenchRequest], dict]:
    """``n`` requests (deterministic in ``seed``) and a description for the result JSON.

    ``max_total_len``: ``max_tokens`` is lowered so that ``prompt_len + max_tokens`` fits (the default leaves 64
    tokens of a 2048 context for the chat template); None disables the clamp."""
    if n <= 0:
        raise DatasetError("the number of requests must be > 0")
    if name not in DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xDA7A]))
    info: dict[str, Any] = {"name": name, "tokenizer": "model" if tokenizer is not None else "1.3 tokens/word"}
    if name == "random":
        reqs = _random(n, rng, tokenizer, random_input_len, random_output_len, random_range_ratio)
        info.update(random_input_len=random_input_len, random_output_len=random_output_len,
                    random_range_ratio=random_range_ratio)
    elif name == "custom":
        reqs = _custom(dataset_path, n, tokenizer, output_len)
        info["path"] = str(dataset_path)
    else:
        sp, info["split"] = choose_split(split, n)
        rows = load_prompts(split=sp)
        if name == "prompts":
            reqs = _native(n, rows, rng, tokenizer, output_len)
        else:
            reqs = _shaped(name, n, rows, rng, tokenizer, output_len)
            spec = SPECS[name]
            info["target"] = {"input": spec.input.describe() if spec.input else "natural",
                              "output": spec.output.describe(), "weights": spec.weights}
    if output_len:
        info["output_len_override"] = output_len
    if max_total_len:
        clamped = sum(r.prompt_len + r.max_tokens > max_total_len for r in reqs)
        reqs = [r if r.prompt_len + r.max_tokens <= max_total_len else
                BenchRequest(r.index, r.prompt, max(1, max_total_len - r.prompt_len), r.prompt_len, r.category,
                             r.source) for r in reqs]
        info.update(max_total_len=max_total_len, max_tokens_clamped=int(clamped))
    info.update(num_requests=len(reqs), input_len=length_stats([r.prompt_len for r in reqs]),
                max_tokens=length_stats([r.max_tokens for r in reqs]))
    return reqs, info


def length_stats(xs) -> dict[str, float]:
    a = np.asarray(xs, dtype=float)
    if not len(a):
        return {}
    return {"mean": round(float(a.mean()), 2), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "min": float(a.min()), "max": float(a.max())}
