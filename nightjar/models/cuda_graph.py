"""CUDA graphs for short steps (decode, verify, draft passes): capture once per shape, replay after.

A step of B rows with at most q query tokens per row and at most ``nlog`` logits rows per row runs the
graph of key (Bb, q, nlog), Bb the smallest batch bucket >= B (1, 2, 4, 8, then multiples of 16 up to
max_batch). Each key owns static inputs — one int64 device buffer holding input_ids, positions,
slot_mapping, logits_index, query_start_loc, seq_lens and block tables of a fixed width — that a step
fills with one host-to-device copy before replaying. The static batch has Bb + 1 rows: the live rows
first, exactly as the eager layout has them, then one sink row that owns the padding tokens
(Bb*q - T of them: slot -1 so nothing is stored, position 0, context length 0 so it reads no KV), then
empty rows (no tokens). Padding logits rows point at token 0 and are cut off.

Everything is eager instead (``forward`` returns None) when the model is not on its Triton path (CPU,
NIGHTJAR_TRITON=0), the KV cache has more than two segments (the kernels' segment table has one entry),
a row needs more query tokens than max_q, more blocks than the table width, or no logits (prefill
chunks), or the batch exceeds the largest bucket.

Graphs bake in addresses: the weights' and the KV segments'. ``weights_moved(model)`` (called by the
draft's offload and reload in transfer/weights.py) drops the model's graphs at once; the runner also
compares, every step, the model's weights version and the data pointers of the KV segments with the ones
its graphs were captured with, and drops them all on a mismatch (capture is lazy, on the next use): a pool
that grows or shrinks re-captures its shapes once.

``capture=False`` keeps everything but the ``torch.cuda.graph`` call: the static buffers are filled
and the model runs eagerly on them. The CPU tests use it with the Triton interpreter.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from nightjar.models.llama import BatchLayout

log = logging.getLogger(__name__)

SINK_SLOT = -1      # kv_store skips slot -1: padding tokens store nothing


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, ... (multiples of 16), with max_batch itself as the last bucket."""
    out = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return out + [max_batch]


@dataclass(frozen=True)
class GraphKey:
    batch: int      # Bb: live rows padded up to this bucket
    q: int          # query tokens per row (the longest live row)
    nlog: int       # logits rows per row (the most any live row needs)

    @property
    def tokens(self) -> int:
        return self.batch * self.q

    @property
    def logits(self) -> int:
        return self.batch * self.nlog


def choose_key(qlens: list[int], logits_rows: list[int], starts: list[int], buckets: list[int], max_q: int,
               width: int, block_size: int) -> GraphKey | None:
    """The graph a step can replay, or None (eager): see the module docstring for the rules."""
    B = len(qlens)
    if B == 0 or B > buckets[-1]:
        return None
    q, nlog = max(qlens), max(logits_rows)
    if q > max_q or min(qlens) < 1 or min(logits_rows) < 1:
        return None
    if max(s + n for s, n in zip(starts, qlens)) > width * block_size:
        return None
    return GraphKey(next(b for b in buckets if b >= B), q, nlog)


@dataclass(frozen=True)
class StaticPlan:
    """Where each field sits in a key's flat int64 buffer (Bs = Bb + 1 rows, the last live-or-sink)."""
    key: GraphKey
    width: int

    @property
    def rows(self) -> int:
        return self.key.batch + 1

    def spans(self) -> dict[str, tuple[int, int]]:
        T, N, Bs = self.key.tokens, self.key.logits, self.rows
        sizes = [("input_ids", T), ("positions", T), ("slot_mapping", T), ("logits_index", N),
                 ("query_start_loc", Bs + 1), ("seq_lens", Bs), ("block_tables", Bs * self.width)]
        out, at = {}, 0
        for name, n in sizes:
            out[name] = (at, at + n)
            at += n
        return out

    @property
    def size(self) -> int:
        return self.spans()["block_tables"][1]


def pack(plan: StaticPlan, chunks: list[list[int]], starts: list[int], tables: list[tuple[int, ...]],
         logits_rows: list[int], block_size: int, out: np.ndarray) -> int:
    """Write one step into ``out`` (int64 [plan.size]) as build_layout would lay it out, plus padding.

    Vectorized over rows and tokens (one numpy op per field). Returns the number of live logits rows
    (the first rows of the graph's logits).
    """
    sp = {k: out[a:b] for k, (a, b) in plan.spans().items()}
    B, T_pad = len(chunks), plan.key.tokens
    out[:] = 0
    q = np.fromiter(map(len, chunks), np.int64, B)                                # [B]
    s = np.asarray(starts, dtype=np.int64)                                        # [B]
    lr = np.asarray(logits_rows, dtype=np.int64)                                  # [B]
    off = np.concatenate(([0], np.cumsum(q)))                                     # [B+1]
    T, N = int(off[-1]), int(lr.sum())
    row = np.repeat(np.arange(B), q)                                              # [T] row of each token
    pos = np.arange(T) + np.repeat(s - off[:-1], q)                               # [T]
    nb = -(-(s + q) // block_size)                                                # [B] blocks each row uses
    bt = sp["block_tables"].reshape(plan.rows, plan.width)                        # [Bb+1, W]
    used = np.arange(plan.width)[None, :] < nb[:, None]                           # [B, W]
    bt[:B][used] = np.fromiter(chain.from_iterable(t[:n] for t, n in zip(tables, nb.tolist())), np.int64)
    sp["input_ids"][:T] = np.fromiter(chain.from_iterable(chunks), np.int64, T)
    sp["positions"][:T] = pos
    sp["slot_mapping"][:T] = bt[row, pos // block_size] * block_size + pos % block_size
    sp["slot_mapping"][T:] = SINK_SLOT    # the sink row's tokens: positions 0, context 0, stored nowhere
    first = np.repeat(off[1:] - lr, lr)                                           # [N] first logits token
    sp["logits_index"][:N] = first + np.arange(N) - np.repeat(np.cumsum(lr) - lr, lr)
    sp["query_start_loc"][1: B + 1] = off[1:]
    sp["query_start_loc"][B + 1:] = T_pad  # sink row ends at T_pad; the rows after it are empty
    sp["seq_lens"][:B] = s + q
    return N


class _Entry:
    """One key's static buffers, its layout views and (when captured) its graph."""

    def __init__(self, plan: StaticPlan, device: torch.device):
        self.plan = plan
        self.dev = torch.zeros(plan.size, dtype=torch.int64, device=device)             # [size]
        pin = device.type == "cuda"
        self.host = torch.zeros(plan.size, dtype=torch.int64, pin_memory=pin)           # [size]
        self.copied = torch.cuda.Event() if pin else None
        v = {k: self.dev[a:b] for k, (a, b) in plan.spans().items()}
        self.layout = BatchLayout(
            input_ids=v["input_ids"], positions=v["positions"], slot_mapping=v["slot_mapping"],
            block_tables=v["block_tables"].view(plan.rows, plan.width), query_start_loc=v["query_start_loc"],
            seq_lens=v["seq_lens"], groups=[], logits_index=v["logits_index"])
        self.graph: torch.cuda.CUDAGraph | None = None

    def load(self, chunks, starts, tables, logits_rows, block_size: int) -> int:
        """Fill the host staging buffer and copy it into the static device buffer; live logits rows."""
        if self.copied is not None:
            self.copied.synchronize()       # the previous step's copy has left the pinned buffer
        n = pack(self.plan, chunks, starts, tables, logits_rows, block_size, self.host.numpy())
        self.dev.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return n


class GraphRunner:
    """Replays captured steps of one (model, KV cache) pair; ``forward`` returns None to mean eager."""

    def __init__(self, model, cache, *, max_batch: int, max_q: int, max_model_len: int,
                 capture: bool | None = None):
        self.model, self.cache = model, cache
        self.block_size = cache.block_size
        self.buckets = batch_buckets(max_batch)
        self.max_q = max_q
        self.width = -(-(max_model_len + max_q) // cache.block_size)     # block-table columns per row
        self.capture = model.device.type == "cuda" if capture is None else capture
        if self.capture and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA model")
        self.entries: dict[GraphKey, _Entry] = {}
        self.stats: Counter = Counter()       # replays, captures, eager, resets
        self._pool = None
        self._logits: torch.Tensor | None = None   # [max_batch * max_q, V] fp32: every graph's output
        self._sig: tuple | None = None
        self.failed = False                    # a capture failed: eager for good

    # ---- validity --------------------------------------------------------------------------------
    def _signature(self) -> tuple | None:
        """What the graphs depend on (the weights and every KV segment's address: a grow or shrink re-captures),
        or None when the Triton path (the only capturable one) is off, the cache is not in the kernels'
        block-major layout or has more segments than the kernels' segment table (two)."""
        segs = self.cache.segments
        if len(segs) > 2 or not self.model.layers[0].self_attn.use_kernels or self.cache.head_major:
            return None
        return weights_version(self.model), tuple(s.data.data_ptr() for s in segs)

    def reset(self) -> None:
        """Drop every graph and static buffer (their memory returns to the allocator)."""
        if self.entries:
            self.stats["resets"] += 1
        self.entries.clear()
        self._pool, self._logits, self._sig = None, None, None

    # ---- the step --------------------------------------------------------------------------------
    def forward(self, chunks: list[list[int]], starts: list[int], tables: list[tuple[int, ...]],
                logits_rows: list[int]) -> torch.Tensor | None:
        """Logits [sum(logits_rows), V] fp32 as the eager forward gives them, or None (run eager)."""
        sig = None if self.failed else self._signature()
        key = sig and choose_key([len(c) for c in chunks], logits_rows, starts, self.buckets, self.max_q,
                                 self.width, self.block_size)
        if key is None:
            self.stats["eager"] += 1
            return None
        if sig != self._sig:
            self.reset()
            self._sig = sig
        entry = self.entries.get(key)
        if entry is None:
            entry = _Entry(StaticPlan(key, self.width), self.model.device)
            n = entry.load(chunks, starts, tables, logits_rows, self.block_size)
            if not self._first_run(entry):
                return None
            self.entries[key] = entry
            self.stats["captures"] += 1
        else:
            n = entry.load(chunks, starts, tables, logits_rows, self.block_size)
            if entry.graph is None:
                self._run(entry)
            else:
                entry.graph.replay()
            self.stats["replays"] += 1
        return self._logits[:n].clone()

    def _first_run(self, entry: _Entry) -> bool:
        """Run a new key's step (capturing its graph on CUDA). A failed capture turns this runner off for
        good (False: the caller runs the step eagerly; the warm-up's KV writes are the ones eager repeats)."""
        if not self.capture:
            self._run(entry)
            return True
        try:
            self._capture(entry)
        except Exception as e:             # noqa: BLE001 - any capture failure means: stay eager
            log.warning("CUDA graph capture failed for %s (%s: %s); this model runs eagerly from now on",
                        entry.plan.key, type(e).__name__, e)
            self.failed = True
            self.reset()
            return False
        return True

    def _run(self, entry: _Entry) -> None:
        """The captured body: the model on the static layout, logits into the shared output buffer."""
        logits = self.model(entry.layout, self.cache)                       # [Bb*nlog, V]
        if self._logits is None:
            rows = self.buckets[-1] * self.max_q
            self._logits = logits.new_empty(rows, logits.shape[-1])          # [rows, V]
        self._logits[: logits.shape[0]].copy_(logits)

    def _capture(self, entry: _Entry) -> None:
        """Warm up on the live step (Triton compiles; KV writes are the same as the replay's), capture, replay."""
        self._run(entry)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the transfer thread may touch CUDA (draft copies) while this thread captures
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._run(entry)
        if self._pool is None:
            self._pool = graph.pool()
        entry.graph = graph
        log.debug("captured a CUDA graph for %s", entry.plan.key)
        graph.replay()


# ---- model hooks --------------------------------------------------------------------------------
def weights_version(model) -> int:
    return getattr(model, "_weights_version", 0)


def weights_moved(model) -> None:
    """The model's parameters now live at new addresses (or nowhere): its graphs are stale."""
    model._weights_version = weights_version(model) + 1
    runner = getattr(model, "graph_runner", None)
    if runner is not None:
        runner.reset()


def attach_graphs(model, cache, *, max_batch: int, max_q: int, max_model_len: int) -> GraphRunner | None:
    """Give ``model`` a runner for ``cache`` when it runs Triton kernels on CUDA; else leave it eager."""
    detach_graphs(model)
    if model.device.type != "cuda" or not model.layers[0].self_attn.use_kernels:
        return None
    model.graph_runner = GraphRunner(model, cache, max_batch=max_batch, max_q=max_q, max_model_len=max_model_len)
    return model.graph_runner


def detach_graphs(model) -> None:
    runner = model.__dict__.pop("graph_runner", None)
    if runner is not None:
        runner.reset()


def graph_forward(model, cache, chunks, starts, tables, logits_rows) -> torch.Tensor | None:
    """run_chunks' hook: the model's runner's logits when it has one for this cache and this shape."""
    runner = getattr(model, "graph_runner", None)
    if runner is None or runner.cache is not cache:
        return None
    return runner.forward(chunks, starts, tables, logits_rows)
