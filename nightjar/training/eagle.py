"""Train an EAGLE-3-style draft head (nightjar/models/eagle.py) for the default target on CPU:
``python -m nightjar.training.eagle --corpus answers.jsonl --out DIR --minutes 50``.

1. Cache: the raw residual stream of the frozen target after ``hc.feature_layers`` (bf16) and its top-k
   next-token distribution per position of every corpus record (memmaps under DIR/cache). Captured while
   the answers were generated (``answers.py --features``, ``CacheWriter``), else a dense bf16 forward of
   the target over prompt+answer fills them, all before training starts (so ``--minutes`` is all
   training), shortest records first, saved every minute: a stopped run resumes.
2. Vocabulary: the ``--vocab`` most frequent tokens of the training split's answers (the target's own
   outputs) form the draft vocabulary (``head.d2t``, sorted by id).
3. Standardisation: per-dimension mean/std of the raw features over ~50k training tokens -> the head's
   ``feat_shift``/``feat_scale`` buffers.
4. Training-time test (EAGLE-3): K unrolled steps; step j >= 1 feeds the head's own previous output
   back as the feature (shifted one position right) and attends to exactly the keys inference sees
   (true entries up to the anchor, then the head's own draft entries). Loss: soft cross-entropy on the
   target's top-k restricted to the draft vocabulary + 0.2 x CE on its argmax, weighted 0.8^j per step.

Alignment: head position p reads the features of target position p and the embedding of x_{p+1}; its
output a_p predicts x_{p+2}, so its label is the target's distribution at position p+1.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from nightjar.models.eagle import DraftHead, HeadConfig, save_head
from nightjar.models.llama import LlamaModel, apply_rope
from nightjar.training.distill import split_validation

TOPK = 16
STEP_DECAY = 0.8
HARD_WEIGHT = 0.2


# ---- 1. target features and top-k ------------------------------------------------------------------
def dense_target(model: LlamaModel, ids: torch.Tensor, layers: tuple[int, ...]):
    """Causal dense forward of the target (no paged cache). ids [B, S] -> (features [B, S, nF*H], the raw
    residual stream after ``layers`` (pre-norm); logits [B, S, V] in the model's dtype)."""
    c = model.cfg
    B, S = ids.shape
    x = model.embed_tokens(ids)                                                   # [B, S, H]
    cos, sin = model.rope(torch.arange(S))                                        # [S, 1, d]
    kept = []
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        q, k, v = a.qkv(layer.input_layernorm(x))
        q = apply_rope(q.view(B, S, c.num_heads, c.head_dim), cos, sin)          # [B, S, nh, d]
        k = apply_rope(k.view(B, S, c.num_kv_heads, c.head_dim), cos, sin)       # [B, S, nkv, d]
        v = v.reshape(B, S, c.num_kv_heads, c.head_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)       # [B, nh, S, d]
        x = x + a.o_proj(o.transpose(1, 2).reshape(B, S, c.q_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in layers:
            kept.append(x)
    return torch.cat(kept, dim=-1), model.lm_head(model.norm(x))


@dataclass
class FeatureCache:
    """Per-token arrays of the whole corpus, record after record (memmaps under ``dir``), filled by record:
    ``cached[r]`` says whether record r's rows hold the target's outputs yet (saved by ``save_flags``)."""

    dir: Path
    tokens: np.ndarray      # [N] int32
    feats: np.ndarray       # [N, nF*H] int16 holding bf16 bits
    topk_ids: np.ndarray    # [N, k] int32: the target's top-k at each position (predicting the next token)
    topk_logp: np.ndarray   # [N, k] float16
    offsets: np.ndarray     # [R] int64: where record r starts
    lengths: np.ndarray     # [R] int64: prompt + answer tokens
    prompt_lens: np.ndarray  # [R] int64
    cached: np.ndarray      # [R] bool
    meta: dict

    @property
    def num_records(self) -> int:
        return len(self.offsets)

    def save_flags(self) -> None:
        """Flush the arrays, then record which records are complete (a stop loses at most the rest)."""
        for a in (self.tokens, self.feats, self.topk_ids, self.topk_logp):
            a.flush()
        np.save(self.dir / "cached.npy", self.cached)


def is_text(record: dict) -> bool:
    """A teacher-forced text record (training/texts.py), not one of the target's answers."""
    return record.get("variant") == "text"


def read_corpus(path: Path, limit: int | None = None) -> tuple[list[dict], int]:
    """(records with an answer among the first ``limit`` complete lines, lines read). A line still being
    written (no newline yet) is not read."""
    recs, lines = [], 0
    with Path(path).open() as f:
        for line in f:
            if (limit is not None and lines >= limit) or not line.endswith("\n"):
                break
            lines += 1
            if line.strip():
                recs.append(json.loads(line))
    return [r for r in recs if r["answer_ids"]], lines


def cache_layout(feature_size: int, k: int) -> dict:
    """Each cache file's dtype and per-token shape (its rows follow the corpus's tokens)."""
    return {"tokens": (np.int32, ()), "feats": (np.int16, (feature_size,)), "topk_ids": (np.int32, (k,)),
            "topk_logp": (np.float16, (k,))}


def open_cache(d: Path, records: list[dict], layers: tuple[int, ...], hidden: int, k: int = TOPK,
               lines: int | None = None) -> FeatureCache:
    """The cache of ``records`` (the first ``lines`` lines of the corpus) in ``d``: reopened when its meta
    matches, else created empty."""
    d.mkdir(parents=True, exist_ok=True)
    lengths = np.array([len(r["prompt_ids"]) + len(r["answer_ids"]) for r in records], dtype=np.int64)
    plen = np.array([len(r["prompt_ids"]) for r in records], dtype=np.int64)
    meta = {"records": len(records), "tokens": int(lengths.sum()), "k": k, "layers": list(layers),
            "feature_size": len(layers) * hidden, "lines": lines if lines is not None else len(records)}
    old = json.loads((d / "meta.json").read_text()) if (d / "meta.json").exists() else None
    reuse = old == meta and (d / "cached.npy").exists()
    N, Fd = meta["tokens"], meta["feature_size"]
    arr = {name: np.memmap(d / f"{name}.bin", dtype=dt, mode="r+" if reuse else "w+", shape=(N, *shape))
           for name, (dt, shape) in cache_layout(Fd, k).items()}
    (d / "meta.json").write_text(json.dumps(meta))
    if not reuse:
        (d / "fill.json").unlink(missing_ok=True)
        (d / "capture.json").unlink(missing_ok=True)
    cached = np.load(d / "cached.npy") if reuse else np.zeros(len(records), dtype=bool)
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    return FeatureCache(dir=d, offsets=offsets, lengths=lengths, prompt_lens=plen, cached=cached, meta=meta, **arr)


def ensure_cached(model: LlamaModel, cache: FeatureCache, records: list[dict], rows: list[int],
                  batch_tokens: int = 2048) -> int:
    """Run the target over the records of ``rows`` not cached yet (padded groups of <= batch_tokens);
    returns how many tokens it ran."""
    todo = sorted((r for r in set(rows) if not cache.cached[r]), key=lambda r: int(cache.lengths[r]))
    i, ran = 0, 0
    while i < len(todo):
        j = i + 1
        while j < len(todo) and (j - i + 1) * int(cache.lengths[todo[j]]) <= batch_tokens:
            j += 1
        _cache_group(model, cache, records, todo[i:j])
        ran += int(cache.lengths[todo[i:j]].sum())
        i = j
    return ran


def fill_cache(model: LlamaModel, cache: FeatureCache, records: list[dict], log=print, chunk: int = 256,
               flag_seconds: float = 60.0) -> int:
    """Every record not cached yet, shortest first (groups pad little), ``chunk`` records at a time; which
    records are done is saved at least every ``flag_seconds`` (a stop loses at most that much work) and the
    time spent adds up in ``fill.json`` across resumed runs. Returns the tokens the target ran."""
    todo = sorted(np.flatnonzero(~cache.cached).tolist(), key=lambda r: int(cache.lengths[r]))
    total, ran, ran_last = int(cache.lengths[todo].sum()), 0, 0
    t0 = last = time.time()
    for i in range(0, len(todo), chunk):
        ran += ensure_cached(model, cache, records, todo[i: i + chunk])
        if time.time() - last >= flag_seconds or i + chunk >= len(todo):
            cache.save_flags()
            _add_fill(cache, time.time() - last, ran - ran_last)
            last, ran_last, rate = time.time(), ran, ran / max(1e-9, time.time() - t0)
            log(f"cache: {ran}/{total} tokens ({rate:.0f} tok/s, {(total - ran) / max(rate, 1e-9) / 60:.1f} min left)")
    return ran


def capture_stats(d: Path) -> dict:
    """{"tokens"}: the cache's tokens whose features were captured while their answers were generated."""
    path = d / "capture.json"
    return json.loads(path.read_text()) if path.exists() else {"tokens": 0}


def fill_stats(cache: FeatureCache) -> dict:
    """{"seconds", "tokens"}: what the target spent filling ``cache`` so far, over all runs (zeros at first)."""
    path = cache.dir / "fill.json"
    return json.loads(path.read_text()) if path.exists() else {"seconds": 0.0, "tokens": 0}


def _add_fill(cache: FeatureCache, seconds: float, tokens: int) -> None:
    done = fill_stats(cache)
    (cache.dir / "fill.json").write_text(json.dumps({"seconds": done["seconds"] + seconds,
                                                     "tokens": done["tokens"] + tokens}))


class CacheWriter:
    """Fills a feature cache while the answers are generated (``python -m nightjar.training.answers --features
    DIR``), so that training finds it full and the target need not run over the corpus again. The cache's files
    grow record by record in corpus order; ``commit`` makes the records written so far the cache of the corpus
    file's lines so far (meta.json, cached.npy), which ``open_cache`` reopens once they match the corpus it
    reads. A record's last position gets no feature and no top-k (nothing reads them: a head position's
    features are at most the record's second-to-last, its labels at most that position's), left zero. Records
    of the corpus without features (written before a stop, or without ``--features``) stay uncached, for
    ``fill_cache``."""

    def __init__(self, d: Path, records: list[dict], lines: int, layers: tuple[int, ...], hidden: int,
                 k: int = TOPK) -> None:
        """``records``/``lines``: what the corpus file holds already (``read_corpus``). What an earlier writer
        committed for a prefix of them is kept."""
        d.mkdir(parents=True, exist_ok=True)
        self.dir, self.layers, self.k, self.fsize = d, tuple(layers), k, len(layers) * hidden
        self.row = {name: np.dtype(dt).itemsize * math.prod(shape)                           # bytes/token
                    for name, (dt, shape) in cache_layout(self.fsize, k).items()}
        self.lengths = [len(r["prompt_ids"]) + len(r["answer_ids"]) for r in records]
        self.lines, self.tokens = lines, sum(self.lengths)
        n = self._committed(records, lines)
        self.cached = (np.load(d / "cached.npy")[:n].tolist() if n else []) + [False] * (len(records) - n)
        self.captured = capture_stats(d)["tokens"] if n else 0
        if not n:                   # another cache, or none: its description goes before its files are emptied
            for name in ("meta.json", "cached.npy", "fill.json", "capture.json"):
                (d / name).unlink(missing_ok=True)
        self.files = {name: open(d / f"{name}.bin", "r+b" if n else "w+b") for name in self.row}
        rest = [np.asarray(r["prompt_ids"] + r["answer_ids"], dtype=np.int32) for r in records[n:]]
        if rest:                    # their tokens (the next writer's prefix check reads them), no features
            self.files["tokens"].seek(4 * sum(self.lengths[:n]))
            self.files["tokens"].write(np.concatenate(rest).tobytes())
        self.commit(lines)          # what the corpus holds now, without features where it has none

    def _committed(self, records: list[dict], lines: int) -> int:
        """Records of an earlier commit that are a prefix of ``records`` (0: none, or another cache)."""
        path = self.dir / "meta.json"
        old = json.loads(path.read_text()) if path.exists() else None
        if old is None or not (self.dir / "cached.npy").exists():
            return 0
        n, want = old["records"], self._meta()
        same = all(old.get(x) == want[x] for x in ("k", "layers", "feature_size"))
        T = sum(self.lengths[:n])
        if not (same and n <= len(records) and old["lines"] <= lines and old["tokens"] == T):
            return 0
        ids = np.concatenate([np.asarray(r["prompt_ids"] + r["answer_ids"], dtype=np.int32) for r in records[:n]]
                             or [np.zeros(0, dtype=np.int32)])
        on_disk = np.fromfile(self.dir / "tokens.bin", dtype=np.int32, count=T)
        return n if len(on_disk) == T and (on_disk == ids).all() else 0

    def _meta(self) -> dict:
        return {"records": len(self.lengths), "tokens": sum(self.lengths), "k": self.k, "layers": list(self.layers),
                "feature_size": self.fsize, "lines": self.lines}

    def append(self, ids: list[int], prompt_len: int, feats: torch.Tensor, topk_ids: torch.Tensor,
               topk_logp: torch.Tensor) -> None:
        """One record: ``ids`` prompt + answer (S tokens), ``feats`` [S-1, nF*H] the target's features of positions
        0..S-2, ``topk_*`` [>= S-prompt_len, k] its top-k at label positions prompt_len-1..S-2."""
        if prompt_len < 1 or len(ids) <= prompt_len:
            raise ValueError("CacheWriter: a record needs a prompt and an answer")
        S, lo = len(ids), prompt_len - 1
        f = torch.zeros((S, self.fsize), dtype=torch.bfloat16)
        f[: S - 1] = feats
        ti, tl = torch.zeros((S, self.k), dtype=torch.int32), torch.zeros((S, self.k), dtype=torch.float16)
        ti[lo: S - 1], tl[lo: S - 1] = topk_ids[: S - 1 - lo].int(), topk_logp[: S - 1 - lo].half()
        parts = {"tokens": np.asarray(ids, dtype=np.int32), "feats": f.view(torch.int16).numpy(),
                 "topk_ids": ti.numpy(), "topk_logp": tl.numpy()}
        for name, a in parts.items():
            fh = self.files[name]
            fh.seek(self.tokens * self.row[name])
            fh.write(a.tobytes())
        self.tokens += S
        self.captured += S
        self.lengths.append(S)
        self.cached.append(True)

    def commit(self, lines: int) -> None:
        """The corpus file now holds ``lines`` lines, the records appended so far among them."""
        self.lines = lines
        for name, fh in self.files.items():
            fh.truncate(self.tokens * self.row[name])
            fh.flush()
        with open(self.dir / "cached.tmp", "wb") as f:        # each file whole or not at all; meta last
            np.save(f, np.array(self.cached, dtype=bool))
        os.replace(self.dir / "cached.tmp", self.dir / "cached.npy")
        (self.dir / "capture.json").write_text(json.dumps({"tokens": self.captured}))
        (self.dir / "meta.tmp").write_text(json.dumps(self._meta()))
        os.replace(self.dir / "meta.tmp", self.dir / "meta.json")

    def close(self) -> None:
        for fh in self.files.values():
            fh.close()


def build_cache(model: LlamaModel, records: list[dict], layers: tuple[int, ...], d: Path, k: int = TOPK,
                log=print) -> FeatureCache:
    """The whole cache at once (resuming what a previous call left)."""
    cache = open_cache(d, records, layers, model.cfg.hidden_size, k)
    fill_cache(model, cache, records, log)
    return cache


@torch.inference_mode()
def _cache_group(model: LlamaModel, cache: FeatureCache, records: list[dict], rows: list[int]) -> None:
    seqs = [records[r]["prompt_ids"] + records[r]["answer_ids"] for r in rows]
    S = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), S), dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    feats, logits = dense_target(model, ids, tuple(cache.meta["layers"]))       # [B, S, F], [B, S, V]
    for b, (s, r) in enumerate(zip(seqs, rows)):
        n, o = len(s), int(cache.offsets[r])
        lo = max(0, int(cache.prompt_lens[r]) - 1)                               # label positions only
        top = logits[b, lo:n].float().log_softmax(-1).topk(cache.meta["k"], dim=-1)  # [n-lo, k]
        cache.tokens[o: o + n] = np.asarray(s, dtype=np.int32)
        cache.feats[o: o + n] = feats[b, :n].to(torch.bfloat16).view(torch.int16).numpy()
        cache.topk_ids[o + lo: o + n] = top.indices.numpy().astype(np.int32)
        cache.topk_logp[o + lo: o + n] = top.values.numpy().astype(np.float16)
        cache.cached[r] = True


# ---- 2. batches: alignment of features, tokens and labels ------------------------------------------
@dataclass
class Batch:
    """Head positions p of each row (a window of its record); padding at the end of rows."""

    feats: torch.Tensor      # [B, T, nF*H] bf16: target features of position p
    emb_ids: torch.Tensor    # [B, T] int64: x_{p+1}
    positions: torch.Tensor  # [B, T] int64: absolute p
    lab_ids: torch.Tensor    # [B, T, k] int64: the target's top-k at position p+1 (predicting x_{p+2})
    lab_logp: torch.Tensor   # [B, T, k] fp32
    mask: torch.Tensor       # [B, T] bool: x_{p+2} is an answer token (label position p+1 in [Lp-1, S-2])


def collate(cache: FeatureCache, rows: list[int], max_len: int = 512) -> Batch:
    """Records ``rows`` -> a padded batch of at most ``max_len`` head positions per row (the last ones)."""
    spans = []
    for r in rows:
        o, S, Lp = int(cache.offsets[r]), int(cache.lengths[r]), int(cache.prompt_lens[r])
        spans.append((o, S, Lp, max(0, S - 1 - max_len)))
    T, B, k = max(S - 1 - s0 for _, S, _, s0 in spans), len(rows), cache.meta["k"]
    feats = torch.zeros((B, T, cache.meta["feature_size"]), dtype=torch.int16)
    emb_ids, positions = torch.zeros((B, T), dtype=torch.int64), torch.zeros((B, T), dtype=torch.int64)
    lab_ids, lab_logp = torch.zeros((B, T, k), dtype=torch.int64), torch.zeros((B, T, k))
    mask = torch.zeros((B, T), dtype=torch.bool)
    for b, (o, S, Lp, s0) in enumerate(spans):
        n, lo, hi = S - 1 - s0, o + s0, o + S - 1          # head positions s0..S-2
        feats[b, :n] = torch.from_numpy(np.array(cache.feats[lo:hi]))
        emb_ids[b, :n] = torch.from_numpy(np.array(cache.tokens[lo + 1: hi + 1])).long()
        positions[b, :n] = torch.arange(s0, S - 1)
        lab_ids[b, :n] = torch.from_numpy(np.array(cache.topk_ids[lo + 1: hi + 1])).long()
        lab_logp[b, :n] = torch.from_numpy(np.array(cache.topk_logp[lo + 1: hi + 1])).float()
        p = positions[b, :n]
        mask[b, :n] = (p >= Lp - 2) & (p <= S - 3)
    return Batch(feats.view(torch.bfloat16), emb_ids, positions, lab_ids, lab_logp, mask)


# ---- 3. vocabulary, initialisation, standardisation ------------------------------------------------
def argmax_counts(cache: FeatureCache, rows: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts over target ids of (the target's argmax at trained label positions, the answer tokens)."""
    arg, ans = torch.zeros(vocab, dtype=torch.int64), torch.zeros(vocab, dtype=torch.int64)
    for r in rows:
        o, S, Lp = int(cache.offsets[r]), int(cache.lengths[r]), int(cache.prompt_lens[r])
        top = torch.from_numpy(np.array(cache.topk_ids[o + Lp - 1: o + S - 1, 0])).long()   # label positions
        arg += torch.bincount(top, minlength=vocab)
        ans += torch.bincount(torch.from_numpy(np.array(cache.tokens[o + Lp: o + S])).long(), minlength=vocab)
    return arg, ans


def select_vocab(counts: torch.Tensor, size: int) -> torch.Tensor:
    """d2t [size]: the ``size`` most frequent target ids, sorted by id (ties: lower id first)."""
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:size].sort().values


def coverage(counts: torch.Tensor, d2t: torch.Tensor) -> float:
    return float(counts[d2t].sum()) / max(1, int(counts.sum()))


def target_to_draft(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """t2d [vocab]: draft id of each target id, -1 outside the draft vocabulary."""
    t2d = torch.full((vocab,), -1, dtype=torch.int64)
    t2d[d2t] = torch.arange(len(d2t))
    return t2d


def init_head(hc: HeadConfig, target_lm_head: torch.Tensor, d2t: torch.Tensor, seed: int) -> DraftHead:
    """Matrices normal(0.02), norms ones; lm_head = the target's LM-head rows of the draft vocabulary."""
    torch.manual_seed(seed)
    head = DraftHead(hc)
    for name, p in head.named_parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    with torch.no_grad():
        head.lm_head.weight.copy_(target_lm_head[d2t].float())
        head.d2t.copy_(d2t)
    return head


def set_standardisation(head: DraftHead, cache: FeatureCache, rows: list[int], tokens: int = 50_000,
                        eps: float = 1e-3) -> None:
    """feat_shift = per-dim mean, feat_scale = 1/(std+eps) of the raw features of ``rows`` (first ~tokens) at the
    positions a head reads (all but each record's last)."""
    chunks, n = [], 0
    for r in rows:
        o, S = int(cache.offsets[r]), int(cache.lengths[r])
        chunks.append(torch.from_numpy(np.array(cache.feats[o: o + S - 1])).view(torch.bfloat16).double())
        n += S - 1
        if n >= tokens:
            break
    f = torch.cat(chunks)                                                         # [n, nF*H]
    with torch.no_grad():
        head.feat_shift.copy_(f.mean(0).float())
        head.feat_scale.copy_((1.0 / (f.std(0) + eps)).float())


# ---- 4. training-time test --------------------------------------------------------------------------
def _shift(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """x moved n places right along ``dim`` (zeros enter at the front)."""
    if n == 0:
        return x
    pad = x.narrow(dim, 0, n).new_zeros(x.narrow(dim, 0, n).shape)
    return torch.cat((pad, x.narrow(dim, 0, x.shape[dim] - n)), dim=dim)


def _ttt_attention(head: DraftHead, x2, cos, sin, keys: list, values: list) -> torch.Tensor:
    """Step j = len(keys): x2 [B, S, 2H] -> attention output [B, S, H]. A query at p sees step-0 keys at
    positions <= p-j and, for k in 1..j, the step-k key at position p-j+k (RoPE of their own positions)."""
    c = head.cfg
    B, S, _ = x2.shape
    nh, nkv, d = c.num_heads, c.num_kv_heads, c.head_dim
    q, k, v = head.self_attn.qkv(x2)
    q = apply_rope(q.view(B, S, nh, d), cos, sin).transpose(1, 2)                 # [B, nh, S, d]
    k = apply_rope(k.view(B, S, nkv, d), cos, sin).repeat_interleave(nh // nkv, 2).transpose(1, 2)
    v = v.reshape(B, S, nkv, d).repeat_interleave(nh // nkv, 2).transpose(1, 2)   # [B, nh, S, d]
    keys.append(k)
    values.append(v)
    j, scale = len(keys) - 1, 1.0 / math.sqrt(d)
    pos = torch.arange(S)
    allowed = pos[None, :] <= pos[:, None] - j                                    # [S, S] key t <= p-j
    scores = [torch.matmul(q, keys[0].transpose(-1, -2)).float().mul(scale).masked_fill(~allowed, float("-inf"))]
    for i in range(1, j + 1):                                                     # [B, nh, S, 1] each
        scores.append((q * _shift(keys[i], j - i, 2)).sum(-1, keepdim=True).float().mul(scale))
    probs = torch.cat(scores, dim=-1).softmax(-1)                                 # [B, nh, S, S+j]
    out = torch.matmul(probs[..., :S].to(values[0].dtype), values[0])             # [B, nh, S, d]
    for i in range(1, j + 1):
        out = out + probs[..., S + i - 1: S + i] * _shift(values[i], j - i, 2)
    return head.self_attn.o_proj(out.transpose(1, 2).reshape(B, S, c.q_size).to(x2.dtype))


def ttt_forward(head: DraftHead, feats: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor,
                steps: int) -> list[torch.Tensor]:
    """feats [B, S, nF*H] raw, emb [B, S, H] (x_{p+1}), positions [B, S] -> outputs a^j [B, S, H] of the
    ``steps`` unrolled steps; step j >= 1 reads a^{j-1} of position p-1 as its feature."""
    B, S, _ = feats.shape
    cos, sin = head.rope(positions.reshape(-1))                                   # [B*S, 1, d]
    cos, sin = cos.view(B, S, 1, -1), sin.view(B, S, 1, -1)
    keys, values, outs = [], [], []
    g = head.fuse(feats.reshape(B * S, -1)).view(B, S, -1)                        # [B, S, H]
    for j in range(steps):
        if j:
            g = _shift(outs[-1], 1, 1)
        outs.append(head.block(emb, g, lambda x2: _ttt_attention(head, x2, cos, sin, keys, values)))
    return outs


class PickedLogProbs(torch.autograd.Function):
    """log_softmax(z)[ids] without materialising the [M, V] log-probabilities or their gradient twice.

    z [M, V] (any float dtype), ids [M, k] -> (picked [M, k] fp32, zmax [M] fp32, no gradient). Backward:
    dz = scatter_add(g at ids) - softmax(z) * sum_k g (softmax kept from forward), in z's dtype. One exp pass, where
    ``.float().log_softmax().gather()`` spends a cast, a log_softmax, a zero-fill and a scatter forward and
    again backward (with the argmax that counted hits, about a quarter of a training step, measured)."""

    @staticmethod
    def forward(ctx, z, ids):
        zf = z.float()                                                            # [M, V]
        zmax = zf.amax(-1, keepdim=True)                                          # [M, 1]
        probs = (zf - zmax).exp_()
        total = probs.sum(-1, keepdim=True)                                       # [M, 1]
        ctx.save_for_backward(probs.div_(total), ids)                             # softmax(z) [M, V] fp32
        ctx.z_dtype = z.dtype
        ctx.mark_non_differentiable(zmax)
        return zf.gather(-1, ids) - (zmax + total.log()), zmax.squeeze(-1)

    @staticmethod
    def backward(ctx, g, _):
        probs, ids = ctx.saved_tensors
        grad = probs.mul(-g.sum(-1, keepdim=True))                                # [M, V]
        return grad.scatter_add_(-1, ids, g).to(ctx.z_dtype), None


def step_loss(head: DraftHead, a: torch.Tensor, mask: torch.Tensor, lab_ids: torch.Tensor,
              lab_logp: torch.Tensor, t2d: torch.Tensor, drop_oov: bool = False):
    """Soft CE on the target's top-k restricted to the draft vocabulary (renormalised) + HARD_WEIGHT x CE on
    its argmax where in-vocabulary. a [B, S, H], mask [B, S]. -> (loss, hits [M] bool: the head's top logit
    is the target's argmax)."""
    ids, tgt = lab_ids[mask], lab_ids[mask][:, 0]                                 # [M, k], [M]
    a, logp = a[mask], lab_logp[mask]                                             # [M, H], [M, k]
    if drop_oov:
        keep = t2d[tgt] >= 0
        ids, tgt, a, logp = ids[keep], tgt[keep], a[keep], logp[keep]
    z = head.logits(a)                                                            # [M, Vd] fp32
    did = t2d[ids]                                                                # [M, k], -1 = outside
    picked, zmax = PickedLogProbs.apply(z, did.clamp_min(0))                      # [M, k] fp32, [M]
    t = logp.softmax(-1) * (did >= 0)
    mass = t.sum(-1)                                                              # [M]
    has, hv = mass > 0, did[:, 0] >= 0
    soft_rows = -(t / mass.clamp_min(1e-9)[:, None] * picked).sum(-1)            # CE to the renormalised top-k
    soft = soft_rows[has].sum() / max(1, int(has.sum()))
    hard = -picked[:, 0][hv].sum() / max(1, int(hv.sum()))
    with torch.no_grad():                      # argmax == target <=> its logit is the max (ties: measure 0)
        hits = hv & (z.gather(-1, did[:, :1].clamp_min(0)).squeeze(-1) >= zmax)
    return soft + HARD_WEIGHT * hard, hits


def batch_loss(head, batch: Batch, emb_table: torch.Tensor, t2d: torch.Tensor, steps: int, drop_oov=False):
    """Unrolled loss sum_j 0.8^j loss_j -> (loss, [(hits, count) per step], [loss_j])."""
    emb = F.embedding(batch.emb_ids, emb_table).to(head.dtype)                   # [B, S, H]
    outs = ttt_forward(head, batch.feats, emb, batch.positions, steps)
    local = torch.arange(batch.mask.shape[1])[None, :]
    total, acc, parts = 0.0, [], []
    for j, a in enumerate(outs):
        m = batch.mask & (local >= j)                                             # anchor p-j inside the window
        loss, hits = step_loss(head, a, m, batch.lab_ids, batch.lab_logp, t2d, drop_oov)
        total = total + STEP_DECAY ** j * loss
        acc.append((int(hits.sum()), int(hits.numel())))
        parts.append(float(loss.detach()))
    return total, acc, parts


def mean_accepted(acc: list[float]) -> float:
    """Expected accepted draft tokens per round under greedy verification: sum_j prod_{i<=j} acc_i."""
    total, run = 0.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


@torch.no_grad()
def evaluate(head, cache, rows, emb_table, t2d, steps, max_len=512, batch=16) -> dict:
    """Per-step top-1 agreement with the target's argmax and the mean loss over ``rows``."""
    hits, counts, losses = [0] * steps, [0] * steps, []
    for i in range(0, len(rows), batch):
        b = collate(cache, rows[i: i + batch], max_len)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, acc, _ = batch_loss(head, b, emb_table, t2d, steps)
        losses.append(float(loss))
        for j, (h, n) in enumerate(acc):
            hits[j] += h
            counts[j] += n
    agree = [round(h / max(1, n), 4) for h, n in zip(hits, counts)]
    return {"loss": round(sum(losses) / max(1, len(losses)), 4), "agree": agree,
            "accepted": round(mean_accepted(agree), 4)}


# ---- 5. training loop --------------------------------------------------------------------------------
@dataclass
class TrainSetup:
    cache: FeatureCache
    train_rows: list[int]
    val_rows: list[int]
    emb_table: torch.Tensor   # [V, H] the target's (frozen) embeddings
    t2d: torch.Tensor         # [V] target id -> draft id or -1
    target: LlamaModel | None = None   # fills the cache for records not cached yet (None: all are)
    records: list | None = None

    def ready(self, rows: list[int]) -> int:
        """Cache ``rows`` with the target where needed; returns the tokens the target ran."""
        if self.target is None:
            return 0
        return ensure_cached(self.target, self.cache, self.records, rows)


def _param_groups(head: DraftHead) -> list[dict]:
    mats = [p for p in head.parameters() if p.dim() > 1]
    vecs = [p for p in head.parameters() if p.dim() == 1]
    return [{"params": mats, "weight_decay": 0.01}, {"params": vecs, "weight_decay": 0.0}]


def _epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()


def _bucketed_order(lengths: list[int], seed: int, epoch: int, batch: int, pool: int = 16) -> list[int]:
    """An epoch's order of indices into ``lengths`` in which each run of ``batch`` has similar lengths: the
    random order cut into pools of ``pool`` batches, each pool sorted by length and cut into batches, the
    batches shuffled (the rows of a last, short batch wait for the next epoch). A batch pads to its longest
    row, so this spends less of a step on padding."""
    order = _epoch_order(len(lengths), seed, epoch)
    batches = []
    for i in range(0, len(order), pool * batch):
        chunk = sorted(order[i: i + pool * batch], key=lambda r: lengths[r])
        batches += [chunk[j: j + batch] for j in range(0, len(chunk) - batch + 1, batch)]
    g = torch.Generator().manual_seed(seed * 1000 + epoch + 500)
    return [r for k in torch.randperm(len(batches), generator=g).tolist() for r in batches[k]]


def train(head: DraftHead, setup: TrainSetup, minutes: float, out: Path, steps: int = 4, lr: float = 8e-4,
          batch: int = 8, max_len: int = 512, seed: int = 0, log=print, max_steps: int | None = None,
          eval_minutes: float = 10.0, eval_records: int = 128, warmup: int = 30, drop_oov: bool = False,
          checkpoint_minutes: float = 5.0) -> dict:
    """AdamW on fp32 master weights (``head``) while the passes run on a bf16 copy (about 2x faster than
    autocast on CPU, measured: no casts around every op), warm-up then a cosine over the budget
    (``schedule_progress``), grad clip 1.0. A checkpoint every ``checkpoint_minutes`` (OUT/checkpoint.pt,
    resumed from); every ``eval_minutes`` and at the end validation agreement per step; the head ends with
    the weights of the best validation mean-accepted estimate."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(_param_groups(head), lr=lr, betas=(0.9, 0.95))
    ckpt = out / "checkpoint.pt"
    state = {"step": 0, "epoch": 0, "pos": 0, "elapsed": 0.0, "losses": [], "step_losses": [], "val": [],
             "best_accepted": -1.0, "best_step": 0, "tokens": 0}
    best = None
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["opt"])
        state, best = saved["state"], saved["best"]
        log(f"resumed at step {state['step']} (epoch {state['epoch']})")
    val_rows = setup.val_rows[:eval_records]
    t_start, last_eval, last_ck = time.time() - state["elapsed"], time.time(), time.time()
    params, work = list(head.parameters()), bf16_copy(head)
    work_params = list(work.parameters())
    window = []

    def finished() -> bool:
        return time.time() - t_start >= minutes * 60 or bool(max_steps and state["step"] >= max_steps)

    def checkpoint(validate: bool):
        nonlocal best
        if (validate and not any(v["step"] == state["step"] for v in state["val"])) or best is None:
            best = _select(head, work, setup, val_rows, steps, max_len, state, best, log)
        setup.cache.save_flags()
        state["elapsed"] = time.time() - t_start
        torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "state": state, "best": best}, ckpt)

    while not finished():
        order = _bucketed_order([int(setup.cache.lengths[r]) for r in setup.train_rows], seed, state["epoch"], batch)
        while state["pos"] + batch <= len(order) and not finished():
            rows = [setup.train_rows[i] for i in order[state["pos"]: state["pos"] + batch]]
            state["pos"] += batch
            state["target_tokens"] = state.get("target_tokens", 0) + setup.ready(rows)
            b = collate(setup.cache, rows, max_len)
            frac = schedule_progress(time.time() - t_start, minutes, state["step"], max_steps)
            cosine = 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac))
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, (state["step"] + 1) / warmup) * cosine
            loss, acc, parts = batch_loss(work, b, setup.emb_table, setup.t2d, steps, drop_oov)
            work.zero_grad(set_to_none=True)
            loss.backward()
            for p, w in zip(params, work_params):
                p.grad = w.grad.float()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            with torch.no_grad():
                for p, w in zip(params, work_params):
                    w.copy_(p)
            state["step"] += 1
            state["tokens"] += int(b.mask.sum())
            state["losses"].append(round(float(loss.detach()), 4))
            state["step_losses"].append([round(x, 4) for x in parts])
            window.append(acc)
            if state["step"] % 20 == 0:
                _log_progress(state, window[-20:], t_start, log)
            if time.time() - last_ck > checkpoint_minutes * 60:
                validate = time.time() - last_eval > eval_minutes * 60
                checkpoint(validate)
                last_ck, last_eval = time.time(), time.time() if validate else last_eval
        if state["pos"] + batch > len(order):
            state["epoch"], state["pos"] = state["epoch"] + 1, 0
    checkpoint(True)
    head.load_state_dict(best)
    state["final_val"] = next((v for v in state["val"] if v["step"] == state["best_step"]), None)
    return state


def schedule_progress(elapsed_s: float, minutes: float, step: int, max_steps: int | None) -> float:
    """How far the run is towards whichever budget ends it first, in [0, 1]: the cosine follows wall time, or
    steps where ``max_steps`` ends the run sooner (so a step-bounded run decays fully whatever the machine's load)."""
    frac = elapsed_s / (minutes * 60)
    if max_steps:
        frac = max(frac, step / max_steps)
    return min(1.0, frac)


def _log_progress(state, window, t_start, log) -> None:
    steps = len(window[0])
    agree = [sum(w[j][0] for w in window) / max(1, sum(w[j][1] for w in window)) for j in range(steps)]
    el = time.time() - t_start
    log(f"step {state['step']} epoch {state['epoch']} loss {sum(state['losses'][-20:]) / 20:.4f} "
        f"train agree {[round(a, 3) for a in agree]} {state['step'] / el:.3f} steps/s "
        f"{state['tokens'] / el:.0f} labelled tok/s, target ran {state.get('target_tokens', 0)} tok, t {el:.0f}s")


def _select(head, work, setup, val_rows, steps, max_len, state, best, log):
    """Validates the bf16 ``work`` copy; keeps the fp32 weights of ``head`` when they are the best yet."""
    if not val_rows:
        return {k: t.detach().clone() for k, t in head.state_dict().items()}
    setup.ready(val_rows)
    v = evaluate(work, setup.cache, val_rows, setup.emb_table, setup.t2d, steps, max_len)
    v["step"] = state["step"]
    state["val"].append(v)
    if v["accepted"] > state["best_accepted"]:
        state["best_accepted"], state["best_step"] = v["accepted"], state["step"]
        best = {k: t.detach().clone() for k, t in head.state_dict().items()}
    log(f"validation at step {state['step']}: agree per step {v['agree']} accepted/round {v['accepted']} "
        f"loss {v['loss']} (best {state['best_accepted']} at step {state['best_step']})")
    return best


def bf16_copy(head: DraftHead) -> DraftHead:
    """A copy with bf16 weights (buffers keep fp32 standardisation and int64 ids)."""
    h = copy.deepcopy(head)
    for p in h.parameters():
        p.data = p.data.to(torch.bfloat16)
    return h


# ---- 6. command line ----------------------------------------------------------------------------------
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", required=True, help="answers JSONL: {id, variant, prompt_ids, answer_ids}")
    ap.add_argument("--out", required=True, help="output dir (head, model card, checkpoint, feature cache)")
    ap.add_argument("--cache", default=None, help="feature cache dir (default OUT/cache)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--minutes", type=float, default=50.0, help="training wall-time budget (after the cache is filled)")
    ap.add_argument("--vocab", type=int, default=8192, help="draft vocabulary size")
    ap.add_argument("--ttt", type=int, default=4, help="unrolled training-time-test steps")
    ap.add_argument("--intermediate", type=int, default=None, help="the head's MLP width (default: the target's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=8e-4)
    ap.add_argument("--batch", type=int, default=8, help="answers per step")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--max-records", type=int, default=None, help="use only the first N corpus lines")
    ap.add_argument("--drop-oov", action="store_true", help="drop positions whose target argmax is outside the vocab")
    a = ap.parse_args(argv)
    if not Path(a.corpus).is_file():
        ap.error(f"--corpus {a.corpus}: no such file (python -m nightjar.training.answers writes one)")
    sizes = [("--minutes", a.minutes), ("--vocab", a.vocab), ("--ttt", a.ttt), ("--batch", a.batch),
             ("--intermediate", a.intermediate), ("--max-steps", a.max_steps)]
    for flag, v in sizes:
        if v is not None and v <= 0:
            ap.error(f"{flag} must be > 0, got {v}")
    if a.cache and Path(a.cache).exists() and not Path(a.cache).is_dir():
        ap.error(f"--cache {a.cache}: not a directory")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(f"[eagle {time.strftime('%H:%M:%S')}] {s}", flush=True)  # noqa: E731
    head, setup, info = prepare(a, out, log)
    state = train(head, setup, a.minutes, out, steps=a.ttt, lr=a.lr, batch=a.batch, max_len=a.max_len,
                  seed=a.seed, log=log, max_steps=a.max_steps, drop_oov=a.drop_oov)
    argmax_coverage(setup, info["coverage"])
    log(f"draft-vocab coverage over {info['coverage'].pop('rows')} cached training answers: {info['coverage']}")
    save_head(bf16_copy(head), out, model_card(head.hc, info, state, a))
    log(f"saved the head to {out} (weights of step {state['best_step']}: {state['final_val']})")


def prepare(a, out: Path, log):
    """Target -> feature cache (filled first) -> vocabulary -> initialised, standardised head + setup."""
    from nightjar.models import load_model

    target = load_model(a.model, dtype="bfloat16", pack=False).model
    hc0 = HeadConfig.for_target(target.cfg, a.vocab)
    if a.intermediate:
        hc0 = replace(hc0, intermediate_size=a.intermediate)
    cache_dir = Path(a.cache) if a.cache else out / "cache"
    meta = cache_dir / "meta.json"
    if (cache_dir / "capture.json").exists() and a.max_records is None:
        records, lines = read_corpus(Path(a.corpus))      # a cache the answers' generator made: the whole corpus,
        CacheWriter(cache_dir, records, lines, hc0.feature_layers, target.cfg.hidden_size).close()   # uncached
    else:                                                 # where it holds no features
        records, lines = read_corpus(Path(a.corpus), json.loads(meta.read_text())["lines"] if meta.exists()
                                     else a.max_records)
        more = Path(a.corpus).read_bytes().count(b"\n") - lines if meta.exists() and a.max_records is None else 0
        if more > 0:
            log(f"the cache in {cache_dir} holds the corpus's first {lines} lines: the {more} after them are not used "
                "(a new --cache uses them)")
    cache = open_cache(cache_dir, records, hc0.feature_layers, target.cfg.hidden_size, lines=lines)
    train_rows, val_rows = split_rows(records)
    V = target.cfg.vocab_size
    ans = answer_counts(records, train_rows, V)
    val = answer_counts(records, val_rows, V)
    cov = {n: {"answer_tokens": round(coverage(ans, select_vocab(ans, n)), 4),
               "val_answer_tokens": round(coverage(val, select_vocab(ans, n)), 4)}
           for n in sorted({4096, 8192, 16384, a.vocab})}
    log(f"{len(records)} records ({cache.meta['tokens']} tokens, {int(cache.cached.sum())} cached); draft-vocab "
        f"coverage of the answers' tokens (train split, validation split): {cov}")
    d2t = select_vocab(ans, a.vocab)
    head = init_head(hc0, target.lm_head.weight.detach(), d2t, a.seed)
    setup = TrainSetup(cache, train_rows, val_rows, target.embed_tokens.weight.detach(), target_to_draft(d2t, V),
                       target, records)
    fill_cache(target, cache, records, log)
    first = [train_rows[i] for i in _epoch_order(len(train_rows), a.seed, 0)]
    first = first[: int(np.searchsorted(np.cumsum(cache.lengths[first]), 50_000)) + 1]
    set_standardisation(head, cache, first)
    info = {"lines": lines, "records": len(records), "train_records": len(train_rows), "val_records": len(val_rows),
            "tokens": int(cache.lengths.sum()),
            "answer_tokens": sum(len(r["answer_ids"]) for r in records if not is_text(r)),
            "text_tokens": sum(len(r["answer_ids"]) for r in records if is_text(r)),
            "prompts": len({r["id"] for r in records if not is_text(r)}),
            "text_records": sum(map(is_text, records)), "coverage": cov, "fill": fill_stats(cache),
            "captured": capture_stats(cache_dir)["tokens"]}
    return head, setup, info


def split_rows(records: list[dict]) -> tuple[list[int], list[int]]:
    """(training rows, validation rows): the answers of every 20th prompt id validate (``split_validation``);
    text records (``is_text``) always train, so that validation measures what the head drafts, answers."""
    _, val_recs = split_validation([r for r in records if not is_text(r)])
    val_ids = {r["id"] for r in val_recs}
    return ([i for i, r in enumerate(records) if r["id"] not in val_ids],
            [i for i, r in enumerate(records) if r["id"] in val_ids])


def answer_counts(records: list[dict], rows: list[int], vocab: int) -> torch.Tensor:
    """[vocab] how often each token is in the answers of ``rows`` (text records left out: the draft vocabulary
    is what the target says)."""
    ids = [t for i in rows if not is_text(records[i]) for t in records[i]["answer_ids"]]
    return torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab)


def argmax_coverage(setup: TrainSetup, cov: dict) -> None:
    """Adds the share of the target's argmax at trained positions (cached training records) per vocab size."""
    rows = [r for r in setup.train_rows if setup.cache.cached[r]]
    arg, ans = argmax_counts(setup.cache, rows, len(setup.t2d))
    for n, c in cov.items():
        c["argmax"] = round(coverage(arg, select_vocab(ans, n)), 4)
    cov["rows"] = len(rows)


def model_card(hc: HeadConfig, info: dict, state: dict, a) -> str:
    v = state["final_val"] or {"agree": [], "accepted": float("nan"), "loss": float("nan")}
    per_step = ", ".join(f"{x:.3f}" for x in v["agree"])
    cov = "\n".join(f"| {n} | {c.get('argmax', float('nan')):.4f} | {c['answer_tokens']:.4f} | "
                    f"{c['val_answer_tokens']:.4f} |"
                    for n, c in sorted(info["coverage"].items()))
    last = state["losses"][-50:]
    return f"""# smollm2-135m-eagle3-head

An EAGLE-3-style draft head for SmolLM2-135M-Instruct (`nightjar/models/eagle.py`), trained by Nightjar on CPU
with `nightjar/training/eagle.py`.

- Shape: one decoder layer of the target's width ({hc.hidden_size}, {hc.num_heads} heads / {hc.num_kv_heads} KV,
  MLP {hc.intermediate_size}) over [target embedding of x_(i+1) | fused features]; features = the raw residual stream
  after target layers {list(hc.feature_layers)}, standardised per dimension (mean/std of ~50k training tokens), then
  `fc`; draft vocabulary {hc.draft_vocab} target ids (the most frequent answer tokens of the training split: the
  target's own answers, its argmax where greedy; ties and unseen ids by lowest id).
- Data: {info['records'] - info['text_records']} answers of the target to {info['prompts']} training prompts
  ({a.corpus}){_texts(info)}: {info['tokens']} tokens (prompt + answer), {info['answer_tokens']} answer tokens;
  {info['train_records']} records train, {info['val_records']} answers validate (every 20th prompt id,
  `distill.split_validation`). The held-out split was never seen. Targets: the target's top-{TOPK} next-token
  distribution and residual stream, cached in bf16.
- Objective: training-time test with {a.ttt} unrolled steps (step j feeds back the head's own outputs; weights
  0.8^j); soft cross-entropy on the target's top-{TOPK} restricted to the draft vocabulary and renormalised
  + 0.2 x CE on the target's argmax where in-vocabulary{' (positions with an out-of-vocabulary argmax dropped)'
                                                           if a.drop_oov else ''}.
- Training: {state['step']} steps of AdamW (batch {a.batch} answers, lr {a.lr:g}, warm-up then cosine over
  {a.minutes:g} min, grad clip 1.0; forward and backward on a bf16 copy, AdamW on fp32 master weights),
  {state['epoch']} full epochs, {state['elapsed'] / 60:.1f} min on 2 CPU cores, after the feature cache was full
  ({info['captured']} tokens captured while the answers were generated, {info['fill']['tokens']} filled by the
  target's forwards in {info['fill']['seconds'] / 60:.1f} min); final training loss
  {sum(last) / max(1, len(last)):.3f} (mean of the last 50 steps); kept the weights of step {state['best_step']}
  (best validation accepted-per-round estimate).
- Validation (first {min(128, info['val_records'])} validation answers, teacher forced): top-1 agreement of the head
  with the target's argmax per draft position: {per_step}; estimated accepted tokens per round
  (sum_j prod_(i<=j) acc_i): {v['accepted']:.3f}; loss {v['loss']:.3f}.

## Vocabulary coverage (training split)

The vocabulary is chosen from the training split's answer tokens; the last column is out of sample (the
first, over the training answers the run cached).

| draft vocab | target argmax, trained positions | training answer tokens | validation answer tokens |
|---|---|---|---|
{cov}

## Reproduce

`python -m nightjar.training.eagle --corpus {a.corpus} --out DIR --minutes {a.minutes:g} --vocab {a.vocab}
--ttt {a.ttt} --seed {a.seed} --lr {a.lr:g} --batch {a.batch}{_extra_flags(a)}` over the first {info['lines']} lines
of the corpus ({_schedule_note(a)}).
"""


def _texts(info: dict) -> str:
    if not info["text_records"]:
        return ""
    return (f" and {info['text_records']} teacher-forced text records (`training/texts.py`: the Python documentation "
            f"as answers, {info['text_tokens']} answer tokens, training only, not in the vocabulary's counts)")


def _schedule_note(a) -> str:
    if a.max_steps:
        return ("the learning-rate schedule follows steps, or wall time where the minutes run out first; the "
                "validations that pick the kept weights come every 10 minutes of wall time")
    return "the learning-rate schedule follows wall time: another machine lands near, not on, these weights"


def _extra_flags(a) -> str:
    flags = [f" --max-len {a.max_len}"] if a.max_len != 512 else []
    flags += [" --drop-oov"] if a.drop_oov else []
    flags += [f" --intermediate {a.intermediate}"] if a.intermediate else []
    return "".join(flags + ([f" --max-steps {a.max_steps}"] if a.max_steps else []))


if __name__ == "__main__":
    main()
