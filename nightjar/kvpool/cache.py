"""KV cache tensors, made of segments so the pool can grow and shrink without copying the cache.

A segment holds blocks ``[start, start + n)`` for every layer: one tensor ``[L, 2, nkv, n, bs, d]`` on CPU
(*head-major*: a KV head's blocks are contiguous, so a gather yields ``[nkv, B, K, d]`` and attention runs
plain batched matmuls on it: gather + attention of a layer 1.26-1.40x faster than on ``[B, K, nkv, d]`` at
B = 16-64, bf16, context 256), and
``[L, 2, n, bs, nkv, d]`` on CUDA (block-major: the layout the Triton kernels and CUDA graphs read).
Growing adds a segment; shrinking drops the last one (after its live blocks were migrated below).

With ``reserve_blocks`` (the engine passes the draft's footprint on CPU) the first segment is allocated
with room to grow into, never touched until used: a grown segment is then a view of the same tensor and
every read stays the one-tensor read (the two-pass ``_gather_segmented`` of a separate segment costs about
2x: 29-39 ms against 14-17 ms over 30 layers of a B = 64, 160-token step). The reserve is host address
space; pages of the grown blocks stay resident after a shrink and are reused by the next grow. On CUDA
memory is real, so there is no reserve.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass
class Segment:
    start: int
    num_blocks: int
    data: torch.Tensor   # [L, 2, nkv, n, bs, d] head-major (CPU), [L, 2, n, bs, nkv, d] block-major (CUDA)
    in_store: bool = False   # a view of KVCache._store (blocks at their global ids)


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_blocks: int, dtype: torch.dtype, device: torch.device | str = "cpu", reserve_blocks: int = 0,
                 head_major: bool | None = None):
        """``head_major``: the layout (module docstring); default head-major on CPU, block-major elsewhere.
        A model on the Triton path needs block-major (``nightjar.models.llama.kv_head_major``)."""
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_size, self.dtype, self.device = block_size, dtype, torch.device(device)
        self.head_major = self.device.type == "cpu" if head_major is None else bool(head_major)
        self._bdim = 3 if self.head_major else 2             # the block dimension of a segment's tensor
        self.segments: list[Segment] = []
        self._bufs: tuple[torch.Tensor, ...] | None = None   # gather scratch (``_scratch``)
        self._store: torch.Tensor | None = None              # _shape(num_blocks + reserve)
        self._base: torch.Tensor | None = None               # every block at its global id (``_refresh``)
        self._layers: list[torch.Tensor] = []                # per layer: ``_base[layer]`` (views made once)
        self._slots: list[torch.Tensor] = []                 # per layer: ``_base[layer]`` by slot (``_slot_view``)
        self.lock = threading.Lock()     # held by a run-ahead step (actors/verifier.py) and a shrink's migration
        self.generation = 0              # +1 whenever blocks move, go or come (a run-ahead planned before is void)
        if num_blocks > 0 and reserve_blocks > 0:
            self._store = torch.empty(self._shape(num_blocks + reserve_blocks), dtype=dtype, device=self.device)
        if num_blocks > 0:
            self.add_segment(num_blocks)

    @staticmethod
    def block_bytes_for(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        dtype: torch.dtype) -> int:
        """Bytes of one block across all layers (K and V)."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.block_bytes_for(self.num_layers, self.num_kv_heads, self.head_dim,
                                    self.block_size, self.dtype)

    @property
    def num_blocks(self) -> int:
        return sum(s.num_blocks for s in self.segments)

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() * s.data.element_size() for s in self.segments)

    def _shape(self, n: int) -> tuple[int, ...]:
        L, bs, nkv, d = self.num_layers, self.block_size, self.num_kv_heads, self.head_dim
        return (L, 2, nkv, n, bs, d) if self.head_major else (L, 2, n, bs, nkv, d)

    def add_segment(self, n: int) -> Segment:
        """Blocks [num_blocks, num_blocks + n), zeroed: a view of the reserve while it has room."""
        start, st = self.num_blocks, self._store
        if st is not None and start + n <= st.shape[self._bdim] and all(s.in_store for s in self.segments):
            seg = Segment(start, n, st.narrow(self._bdim, start, n).zero_(), in_store=True)
        else:
            seg = Segment(start, n, torch.zeros(self._shape(n), dtype=self.dtype, device=self.device))
        self.segments.append(seg)
        self._refresh()
        return seg

    def _refresh(self) -> None:
        """``_base``: the one tensor (``_shape``) holding every block at its global id (one
        segment, or all of them in the reserve), else None; recomputed whenever the segments change."""
        segs = self.segments
        if len(segs) == 1:
            self._base = segs[0].data
        elif self._store is not None and all(s.in_store for s in segs):
            self._base = self._store
        else:
            self._base = None
        base = self._base
        self._layers = [] if base is None else list(base.unbind(0))
        self._slots = [self._slot_view(x) for x in self._layers]

    def _whole(self, layer: int) -> torch.Tensor | None:
        """``_base`` of one layer ([2, nkv, n, bs, d] or [2, n, bs, nkv, d]), or None when the pool is
        several tensors (views made once per layout change: indexing per layer per step costs µs each)."""
        return self._layers[layer] if self._layers else None

    def layer_slots(self, layer: int) -> torch.Tensor | None:
        """Head-major caches held as one tensor: the layer's K and V by slot [2, nkv, S, d] (the view the
        fused CPU ops write and read, models/cpu_fused.py); None otherwise."""
        return self._slots[layer] if self._slots and self.head_major else None

    def slots_by_layer(self) -> list[torch.Tensor] | None:
        """``layer_slots`` of every layer as one list read at once: the pool may grow or shrink on the event loop
        while a forward runs on the compute thread, and a forward must see one layout from its first layer to
        its last (a step's blocks are all in the views it started with)."""
        slots = self._slots
        return slots if slots and self.head_major else None

    def drop_last_segment(self) -> int:
        if len(self.segments) <= 1:
            raise RuntimeError("the first KV segment cannot be dropped")
        n = self.segments.pop().num_blocks
        self.generation += 1
        self._refresh()
        return n

    def __getstate__(self) -> dict:          # copies (deepcopy in tests) get a lock of their own
        state = self.__dict__.copy()
        del state["lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()

    def _slot_view(self, layer_data: torch.Tensor) -> torch.Tensor:
        """One layer's K and V by slot: [2, nkv, n*bs, d] head-major, [2, n*bs, nkv, d] block-major."""
        nkv, d = self.num_kv_heads, self.head_dim
        return layer_data.view(2, nkv, -1, d) if self.head_major else layer_data.view(2, -1, nkv, d)

    def _put(self, by_slot: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, nkv, d] into ``slots`` [T] of one layer's ``_slot_view``, in one copy."""
        kv = torch.stack((k, v))                                                # [2, T, nkv, d]
        if self.head_major:
            by_slot.index_copy_(2, slots, kv.transpose(1, 2))
        else:
            by_slot.index_copy_(1, slots, kv)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store k, v [T, nkv, d] into global slots [T]."""
        if self._slots:
            self._put(self._slots[layer], slots, k, v)
            return
        bs = self.block_size
        for seg in self.segments:
            lo, hi = seg.start * bs, (seg.start + seg.num_blocks) * bs
            sel = ((slots >= lo) & (slots < hi)).nonzero().squeeze(1)           # [t]
            if sel.numel():
                self._put(self._slot_view(seg.data[layer]), slots[sel] - lo, k[sel], v[sel])

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read blocks [B, nb] -> k, v [B, nb*bs, nkv, d] (views of ``gather_heads``' buffers when
        head-major). On CPU (and with more than one segment) they are views of buffers the next gather on
        this cache overwrites: use them (or clone) before gathering again."""
        if self.head_major:
            k, v = self.gather_heads(layer, block_tables)                        # [nkv, B, nb*bs, d]
            return k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
        B, nb = block_tables.shape
        d = self._whole(layer)                                                  # [2, n, bs, nkv, d]
        if d is not None:
            flat = block_tables.reshape(-1)                                     # [B*nb]
            k, v = d[0].index_select(0, flat), d[1].index_select(0, flat)
        else:
            k, v = self._gather_segmented(layer, block_tables)
        shape = (B, nb * self.block_size, self.num_kv_heads, self.head_dim)
        return k.reshape(shape), v.reshape(shape)

    def gather_heads(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Head-major caches: blocks [B, nb] -> k, v [nkv, B, nb*bs, d], contiguous, in reused buffers
        (index_select copies whole blocks of one head: 2.4-2.8x faster than advanced indexing; fresh
        multi-MB outputs would page-fault on every layer)."""
        B, nb = block_tables.shape
        flat = block_tables.reshape(-1)                                         # [B*nb]
        d = self._whole(layer)                                                  # [2, nkv, n, bs, d]
        if d is not None:
            kv = self._scratch(flat.numel(), pair=True)                         # [2, nkv, B*nb, bs, d]
            torch.index_select(d, 2, flat, out=kv)                              # whole blocks, one call
            k, v = kv.unbind(0)
        else:
            k, v = self._gather_segmented(layer, block_tables)
        shape = (self.num_kv_heads, B, nb * self.block_size, self.head_dim)
        return k.view(shape), v.view(shape)

    def _gather_segmented(self, layer: int, tables: torch.Tensor):
        """Blocks from several segments in two passes: each segment's blocks index_selected straight into
        a scratch buffer in segment order, then put back in table order by one more index_select into
        reused K/V buffers (the boolean-mask gather this replaces took 8x the single-segment read and
        made a B = 64 step 1.4x slower once the pool had grown by a segment; this takes about 2x).
        Returns [B*nb, bs, nkv, d] each (block-major) or [nkv, B*nb, bs, d] (head-major)."""
        flat = tables.reshape(-1)                                               # [N] = [B*nb]
        picks, slots = [], []                                                   # segments holding any
        for seg in self.segments:
            pos = ((flat >= seg.start) & (flat < seg.start + seg.num_blocks)).nonzero().squeeze(1)   # [m]
            if pos.numel():
                picks.append((seg, flat.index_select(0, pos) - seg.start))
                slots.append(pos)
        order = torch.cat(slots)                                                # [N]: table slot of pick j
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)           # table slot -> pick j
        buf, k, v = self._scratch(order.numel())
        heads = range(self.num_kv_heads) if self.head_major else (None,)
        for kv, out in ((0, k), (1, v)):
            for h in heads:
                o, b_h, out_h = 0, (buf if h is None else buf[h]), (out if h is None else out[h])
                for seg, ids in picks:
                    src = seg.data[layer, kv] if h is None else seg.data[layer, kv, h]   # [n, bs, (nkv,) d]
                    torch.index_select(src, 0, ids, out=b_h[o: o + ids.numel()])
                    o += ids.numel()
                torch.index_select(b_h, 0, inv, out=out_h)
        return k, v

    def _scratch(self, n: int, pair: bool = False):
        """Three contiguous buffers of n blocks ([nkv, n, bs, d] head-major, [n, bs, nkv, d] block-major),
        carved from reused storage grown as needed: fresh 8 MB tensors per layer cost more in first-touch
        page faults than the copies into them. The last two (K, V) are adjacent: with ``pair`` they come as
        one [2, ...] tensor."""
        bs, nkv, d = self.block_size, self.num_kv_heads, self.head_dim
        size = n * bs * nkv * d
        if self._bufs is None or self._bufs[0].numel() < size:
            self._bufs = (torch.empty(size, dtype=self.dtype, device=self.device),
                          torch.empty(2 * size, dtype=self.dtype, device=self.device))
        shape = (nkv, n, bs, d) if self.head_major else (n, bs, nkv, d)
        kv = self._bufs[1][: 2 * size].view(2, *shape)
        return kv if pair else (self._bufs[0][:size].view(shape), kv[0], kv[1])

    def _locate(self, block: int) -> tuple[int, int]:
        """(segment index, local block id) of a global block id."""
        for i, seg in enumerate(self.segments):
            if seg.start <= block < seg.start + seg.num_blocks:
                return i, block - seg.start
        raise IndexError(f"block {block} is outside the cache ({self.num_blocks} blocks)")

    def migrate(self, pairs: list[tuple[int, int]]) -> None:
        """Copy every (src, dst) block for all layers (pool shrink): ``copy_blocks``, and the blocks moved."""
        self.generation += 1
        self.copy_blocks(pairs)

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy K and V of every (src, dst) slot for all layers (a few slots: one copy each, any layout)."""
        bs, bd = self.block_size, self._bdim
        for src, dst in pairs:
            (si, s), (di, d) = self._locate(src // bs), self._locate(dst // bs)
            a = self.segments[si].data.select(bd, s).select(bd, src % bs)       # [L, 2, nkv, d]
            self.segments[di].data.select(bd, d).select(bd, dst % bs).copy_(a)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy every (src, dst) block for all layers.

        Pairs are grouped by (source segment, destination segment). Within one segment on CUDA, one
        launch of the Triton kernel (triton_kernels/block_migration.py); otherwise one gather and one
        scatter per group, whatever the number of blocks.
        """
        groups: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for src, dst in pairs:
            (si, s), (di, d) = self._locate(src), self._locate(dst)
            srcs, dsts = groups.setdefault((si, di), ([], []))
            srcs.append(s)
            dsts.append(d)
        for (si, di), (srcs, dsts) in groups.items():
            if si == di and self._triton():
                from nightjar.triton_kernels.block_migration import migrate_blocks_triton

                migrate_blocks_triton(self.segments[si].data, list(zip(srcs, dsts)))
                continue
            src_idx = torch.tensor(srcs, device=self.device)
            dst_idx = torch.tensor(dsts, device=self.device)
            moved = self.segments[si].data.index_select(self._bdim, src_idx)     # the P moved blocks
            self.segments[di].data.index_copy_(self._bdim, dst_idx, moved)

    def _triton(self) -> bool:
        from nightjar.triton_kernels import use_triton

        return use_triton() and self.device.type == "cuda"

    def to_host(self) -> list[torch.Tensor]:
        """Copies of the segments' data on the CPU (for draft KV offload)."""
        return [seg.data.to("cpu", copy=True) for seg in self.segments]

    def release(self) -> int:
        """Drop every segment's tensor; returns the bytes released."""
        n = self.nbytes
        for seg in self.segments:
            seg.data, seg.in_store = torch.empty(0, dtype=self.dtype, device=self.device), False
        self._bufs = self._store = None
        self._refresh()
        return n

    def restore(self, host: list[torch.Tensor]) -> None:
        for seg, data in zip(self.segments, host):
            seg.data = data.to(self.device, copy=True)
        self._refresh()


class HeadCache(KVCache):
    """A draft head's cache: its one layer's paged KV plus, in the same blocks, the fused target
    features [H] of each committed position (the head's input while it catches up). Offload copies,
    releases and restores both; the draft executor owns which positions hold what."""

    def __init__(self, num_kv_heads: int, head_dim: int, feat_dim: int, block_size: int, num_blocks: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", head_major: bool | None = None):
        self.feat_dim = feat_dim
        self.feats: list[torch.Tensor] = []            # per segment [n, bs, H]
        super().__init__(1, num_kv_heads, head_dim, block_size, num_blocks, dtype, device, head_major=head_major)

    @staticmethod
    def head_block_bytes(num_kv_heads: int, head_dim: int, feat_dim: int, block_size: int,
                         dtype: torch.dtype) -> int:
        """Bytes of one block: one layer's K and V plus a feature row per slot."""
        kv = KVCache.block_bytes_for(1, num_kv_heads, head_dim, block_size, dtype)
        return kv + block_size * feat_dim * dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return self.head_block_bytes(self.num_kv_heads, self.head_dim, self.feat_dim, self.block_size, self.dtype)

    @property
    def nbytes(self) -> int:
        return super().nbytes + sum(f.numel() * f.element_size() for f in self.feats)

    def add_segment(self, n: int) -> Segment:
        if self.segments:
            raise RuntimeError("a draft head's cache has one segment")
        self.feats.append(torch.zeros((n, self.block_size, self.feat_dim), dtype=self.dtype, device=self.device))
        return super().add_segment(n)

    def write_features(self, g: torch.Tensor, slots: torch.Tensor) -> None:
        """g [T, H] into slots [T]."""
        self.feats[0].view(-1, self.feat_dim).index_copy_(0, slots, g.to(self.dtype))

    def read_features(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [T] -> [T, H]."""
        return self.feats[0].view(-1, self.feat_dim).index_select(0, slots)

    def to_host(self) -> list[torch.Tensor]:
        return super().to_host() + [f.to("cpu", copy=True) for f in self.feats]

    def release(self) -> int:
        n = self.nbytes
        super().release()
        self.feats = [torch.empty(0, dtype=self.dtype, device=self.device) for _ in self.feats]
        return n

    def restore(self, host: list[torch.Tensor]) -> None:
        k = len(self.segments)
        super().restore(host[:k])
        self.feats = [f.to(self.device, copy=True) for f in host[k:]]
