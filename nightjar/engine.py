"""The embedded asyncio engine: wires the actors on one bus and serves ``generate()`` streams."""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, ClassVar

import msgspec
import torch

from nightjar.actors.admission import context_limit
from nightjar.actors.control import ControlSpec
from nightjar.actors.draft import DraftBuffers, DraftExecutor
from nightjar.actors.draft_head import HeadDraftExecutor
from nightjar.actors.draft_ngram import NgramDraftExecutor, parse_ngram
from nightjar.actors.verifier import Verifier
from nightjar.actors.weights import DraftSlot
from nightjar.config_check import check_config
from nightjar.detok import IncrementalText
from nightjar.kernel.actor import Actor
from nightjar.kernel.bus import Bus
from nightjar.kernel.clock import MonotonicClock
from nightjar.kernel.config import EngineConfig
from nightjar.kernel.messages import (
    AbortRequest,
    FinishReason,
    RequestRejected,
    StepTimed,
    SubmitRequest,
    TokensCommitted,
)
from nightjar.kvpool.blocks import BlockAllocator
from nightjar.kvpool.cache import HeadCache, KVCache
from nightjar.models import LoadedModel
from nightjar.models.cuda_graph import attach_graphs, detach_graphs
from nightjar.models.eagle import is_head
from nightjar.models.llama import kv_head_major
from nightjar.models.quant import draft_mode, load_quantized
from nightjar.sampling import ConfigError, EngineError, RequestError, RequestOutput, SamplingParams

log = logging.getLogger("nightjar")


@dataclass
class EngineStats:
    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    num_drafts: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    tokens_emitted: int = 0
    tree_hits: int = 0               # rows that took a sibling of their first draft (draft tree)

    def observe(self, t: StepTimed) -> None:
        self.steps += 1
        self.tokens_emitted += t.tokens_emitted
        self.tree_hits += t.tree_hits
        if t.gamma:
            self.num_drafts += t.num_drafts
            self.draft_tokens += sum(t.drafted_per_pos) if t.drafted_per_pos else t.num_drafts * t.gamma
            self.accepted_tokens += sum(t.accepted_per_pos)
            pos = self.accepted_per_pos
            pos.extend([0] * (len(t.accepted_per_pos) - len(pos)))
            for i, a in enumerate(t.accepted_per_pos):
                pos[i] += a


class Collector(Actor):
    """The client edge: routes committed tokens and rejections to per-request queues."""
    name: ClassVar[str] = "collector"
    subscribes = (TokensCommitted, RequestRejected, StepTimed)

    def __init__(self) -> None:
        super().__init__()
        self.queues: dict[int, asyncio.Queue] = {}
        self.live: set[int] = set()        # ids submitted and not yet finished or rejected by the engine
        self.stats = EngineStats()

    def handle(self, msg, now):
        match msg:
            case TokensCommitted():
                pos = 0
                for rid, n, fin, npr in itertools.zip_longest(msg.req_ids, msg.counts, msg.finish, msg.num_prompt):
                    if fin:
                        self.live.discard(rid)
                    q = self.queues.get(rid)
                    if q is not None:
                        q.put_nowait((list(msg.tokens[pos: pos + n]), FinishReason(fin), npr or 0))
                    pos += n
            case RequestRejected():
                self.live.discard(msg.req_id)
                q = self.queues.get(msg.req_id)
                if q is not None:
                    q.put_nowait(RequestError(msg.message, msg.status))
            case StepTimed():
                self.stats.observe(msg)
        return None


def _device_total_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass
class MemoryPlan:
    budget: int | None
    target_bytes: int
    draft_bytes: int
    draft_kv_bytes: int
    block_bytes: int
    num_blocks: int
    draft_num_blocks: int

    @property
    def draft_footprint(self) -> int:
        return self.draft_bytes + self.draft_kv_bytes


def plan_memory(cfg: EngineConfig, target: LoadedModel, draft: LoadedModel | None) -> MemoryPlan:
    """Split the device budget: target weights + draft (weights + KV) + target KV pool."""
    tc, dtype = target.config, target.model.dtype
    block = KVCache.block_bytes_for(tc.num_layers, tc.num_kv_heads, tc.head_dim, cfg.block_size, dtype)
    dbytes = draft.model.weight_bytes() if draft else 0
    budget = None
    if cfg.num_blocks is not None:
        n = cfg.num_blocks
    elif cfg.device_memory is not None:
        total = _device_total_bytes(target.model.device)
        budget = int(cfg.device_memory * total if cfg.device_memory <= 1 else cfg.device_memory)
        n = None
    else:
        n = min(cfg.max_num_seqs * cfg.max_model_len // cfg.block_size, 2048)
    d_blocks, d_block_bytes = 0, 0
    if draft:
        d_block_bytes = draft_block_bytes(draft, cfg.block_size, dtype)
    if n is None:
        free = budget - target.model.weight_bytes() - dbytes
        per_block = block + d_block_bytes          # the draft KV mirrors the pool's token capacity
        n = free // per_block
        if n < 4:
            raise ValueError(f"device_memory {budget} B leaves no room for the KV pool "
                             f"(target {target.model.weight_bytes()} B + draft {dbytes} B)")
    if draft:
        d_blocks = -(-(cfg.draft_kv_tokens or n * cfg.block_size) // cfg.block_size)
    return MemoryPlan(budget, target.model.weight_bytes(), dbytes, d_blocks * d_block_bytes, block, int(n), d_blocks)


def draft_block_bytes(draft: LoadedModel, block_size: int, dtype) -> int:
    """Bytes of one draft cache block: an independent draft's KV, or a head's KV plus its stored features."""
    dc = draft.config
    if is_head(draft.model):
        return HeadCache.head_block_bytes(dc.num_kv_heads, dc.head_dim, dc.hidden_size, block_size, dtype)
    return KVCache.block_bytes_for(dc.num_layers, dc.num_kv_heads, dc.head_dim, block_size, dtype)


def _load_or_explain(field: str, spec, load):
    """Run ``load``; a file that exists but does not load (a truncated GGUF, a broken checkpoint or head
    directory, a draft of another vocabulary) becomes a ConfigError naming it: one line at the edge."""
    try:
        return load()
    except (ValueError, KeyError, OSError, EOFError, RuntimeError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(field, f"cannot load {spec}: {type(e).__name__}: {e}") from e


def read_planner_profile(path: str | None) -> dict | None:
    """The planner's step-time model from a ``nightjar profile`` JSON file (as the trace header records it)."""
    if path is None:
        return None
    with open(path) as f:
        return {"profile": json.load(f), "scale": 1.0}


_DEFAULTS = EngineConfig()         # Engine's positional defaults are EngineConfig's


class Engine:
    """``async with Engine(model=..., draft=..., policy=...) as engine: async for out in engine.generate(...)``."""

    def __init__(self, model: str = _DEFAULTS.model, draft: str | None = _DEFAULTS.draft,
                 policy: str = _DEFAULTS.policy, *, loaded: tuple[LoadedModel, LoadedModel | None] | None = None,
                 **kwargs: Any):
        self.config = EngineConfig(model=str(model), draft=None if draft is None else str(draft),
                                   policy=policy, **kwargs)
        self._loaded = loaded
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count(1)
        self._error: BaseException | None = None
        self.started = False

    # ---- lifecycle -----------------------------------------------------------------------------
    def _cached_profile(self) -> str:
        """``planner_profile="auto"``, as the CLI's ``--planner-profile auto``: this machine's cached profile
        for the model, draft, dtype and quantization, measured first (about 35 s) when there is none."""
        from nightjar.profile_cache import cached_profile

        c = self.config
        return cached_profile(c.model, c.draft, c.dtype, c.block_size, c.device, log=log.info,
                              quantization=c.quantization,
                              draft_quantization=draft_mode(c.quantization, c.draft_quantization))

    def _load(self) -> tuple[LoadedModel, LoadedModel | None]:
        c = self.config
        if self._loaded is not None:
            return self._loaded
        target = _load_or_explain("model", c.model, lambda: load_quantized(c.model, c.dtype, c.device, c.quantization))
        if c.policy == "off" or self.ngram is not None:        # the n-gram drafter has no weights to load
            return target, None
        dq = draft_mode(c.quantization, c.draft_quantization)
        return target, _load_or_explain("draft", c.draft, lambda: load_quantized(
            c.draft, c.dtype, c.device, dq, draft_for=target.config, seed=c.seed))

    def _build(self) -> None:
        c = self.config
        check_config(c, models=self._loaded is None)
        if c.planner_profile == "auto":
            self.config = c = msgspec.structs.replace(c, planner_profile=self._cached_profile())
        self._planner_profile = read_planner_profile(c.planner_profile)
        self.target, self.draft = self._load()
        if c.draft_tree and self.draft is not None and not is_head(self.draft.model):
            raise ConfigError("draft_tree", "needs a draft head (--draft default or a head directory), "
                              "not an independent draft model")
        self.tokenizer = self.target.tokenizer
        self.memory = plan_memory(c, self.target, self.draft)
        tc = self.target.config
        if self.max_model_len < min(c.max_model_len, tc.max_position):
            log.warning("max_model_len is %d tokens, not %d: the KV pool holds %d tokens with the draft resident "
                        "(raise the memory budget or --num-blocks, or lower --max-model-len)", self.max_model_len,
                        min(c.max_model_len, tc.max_position), self.memory.num_blocks * c.block_size)
        dev, dtype = self.target.model.device, self.target.model.dtype
        self.cache = KVCache(tc.num_layers, tc.num_kv_heads, tc.head_dim, c.block_size, self.memory.num_blocks,
                             dtype, dev, reserve_blocks=self._kv_reserve(dev),
                             head_major=kv_head_major(self.target.model))
        self.clock = MonotonicClock()
        self.bus = Bus(self.clock)
        self.collector = Collector()
        self.actors = self._make_actors()
        for a in self.actors + [self.collector]:
            a.attach(self.bus)

    def _kv_reserve(self, dev: torch.device) -> int:
        """Blocks the pool may grow by when the draft is offloaded, reserved (untouched) on CPU so the grown
        pool stays one tensor (kvpool/cache.py); none on CUDA, where the reserve would be real memory."""
        from nightjar.actors.control import elastic_enabled

        m = self.memory
        if dev.type != "cpu" or self.draft is None or not elastic_enabled(self.config):
            return 0
        return m.draft_footprint // m.block_bytes

    def _make_actors(self) -> list[Actor]:
        """The control plane from the same factories replay and simulation use; then the model actors."""
        from nightjar.actors.control import build_control_actors

        c = self.config
        spec = self.control_spec()
        built = build_control_actors(spec)
        self.batcher, self.planner, self.weights = built["batcher"], built["planner"], built["weights"]
        kv = built["kv"]
        kv.cache, self.allocator = self.cache, kv.alloc
        slot = self._draft_slot()
        if self.ngram is None:          # the n-gram drafter keeps the control plane's StubSlot: weightless, resident
            self.weights.slot = slot
        self.weights.await_quiesced = slot is not None     # the draft executor says when it stops touching it
        self._attach_graphs(slot)
        buffers = DraftBuffers()
        head = slot is not None and is_head(slot.model)
        capture = slot.model.hc.feature_layers if head else ()
        actors = [built["admission"], self.batcher, self.planner, kv, self.weights,
                  Verifier(self.target.model, self.cache, c.block_size, buffers, c.seed, c.synthetic_acceptance,
                           capture=capture, eos_ids=spec.eos_token_ids, max_model_len=spec.max_len,
                           run_ahead=c.run_ahead)]
        if self.ngram is not None:
            actors.append(NgramDraftExecutor(buffers, c.seed, self.target.config.vocab_size, self.target.model.device,
                                             self.ngram))
            actors[-1].relay_to = actors[-2]
        elif slot is not None:
            self.draft_allocator = BlockAllocator(self.memory.draft_num_blocks, c.block_size)
            actors.append(HeadDraftExecutor(slot, self.draft_allocator, buffers, c.seed,
                                            embed=self.target.model.embed_tokens, tree=c.draft_tree,
                                            tree_batch=c.draft_tree_batch, lookup=c.prompt_lookup) if head else
                          DraftExecutor(slot, self.draft_allocator, buffers, c.seed))
            actors[-1].relay_to = actors[-2]        # drafts go straight to the verifier (kernel/actor.py)
        return actors

    def _attach_graphs(self, slot: DraftSlot | None) -> None:
        """CUDA graphs for the target's and the draft's short steps (models/cuda_graph.py) unless
        enforce_eager; attach_graphs leaves a model eager off CUDA or off its Triton path."""
        head = slot is not None and is_head(slot.model)
        models = [(self.target.model, self.cache)] + ([(slot.model, slot.cache)] if slot and not head else [])
        c = self.config
        for model, cache in models:
            detach_graphs(model)
            if not c.enforce_eager:
                attach_graphs(model, cache, max_batch=c.max_num_seqs, max_q=c.gamma_max + 1,
                              max_model_len=self.max_model_len)

    @property
    def max_model_len(self) -> int:
        """The context every request may use, and what the server advertises: max_model_len capped by the
        model's positions and by the base KV pool (always there; it only grows while the draft is offloaded)."""
        c = self.config
        return context_limit(min(c.max_model_len, self.target.config.max_position),
                             self.memory.num_blocks * c.block_size)

    def device_bytes(self) -> dict[str, int]:
        """Bytes the engine holds on its device now (the budget covers their sum)."""
        draft_w = self.draft.model.weight_bytes() if self.draft else 0     # as the budget counts them, packed too
        draft_kv = self.weights.slot.cache.nbytes if self.weights.slot else 0
        out = {"target": self.target.model.weight_bytes(), "draft_weights": draft_w, "draft_kv": draft_kv,
               "kv_pool": self.cache.nbytes}
        out["total"] = sum(out.values())
        return out

    def _draft_slot(self) -> DraftSlot | None:
        if self.draft is None:
            return None
        dc, c = self.draft.config, self.config
        if is_head(self.draft.model):
            cache = HeadCache(dc.num_kv_heads, dc.head_dim, dc.hidden_size, c.block_size,
                              self.memory.draft_num_blocks, self.draft.model.dtype, self.draft.model.device,
                              head_major=kv_head_major(self.draft.model))
            return DraftSlot(self.draft.model, cache, self.draft.model.device)
        cache = KVCache(dc.num_layers, dc.num_kv_heads, dc.head_dim, c.block_size, self.memory.draft_num_blocks,
                        self.draft.model.dtype, self.draft.model.device, head_major=kv_head_major(self.draft.model))
        return DraftSlot(self.draft.model, cache, self.draft.model.device)

    async def start(self) -> "Engine":
        if self.started:
            return self
        # loads, allocations and forwards all on the one compute thread (kernel/threads.py: a second
        # thread that ever ran torch's parallel CPU work made every forward ~2x slower); with inline_compute
        # that thread is the event loop's own
        self._executor = (None if self.config.inline_compute
                          else ThreadPoolExecutor(1, thread_name_prefix="nightjar-compute"))
        try:
            await self._on_compute_thread(self._build)
        except BaseException:
            if self._executor is not None:
                self._executor.shutdown(wait=False)
            raise
        if self.config.synthetic_acceptance is not None:
            log.warning("SYNTHETIC ACCEPTANCE %.2f: drafts are accepted at random; outputs are NOT the target's",
                        self.config.synthetic_acceptance)
        self._open_trace()
        if self.draft is not None:                  # a drafter with weights to move
            from nightjar.transfer.weights import DraftTransfer

            self.weights.transfer = DraftTransfer(asyncio.get_running_loop(), failed=self.weights.copy_failed,
                                                  device=self.weights.slot.device)
        for a in self.actors + [self.collector]:
            task = asyncio.create_task(a.run(self._executor), name=f"actor:{a.name}")
            task.add_done_callback(self._on_actor_done)
            self._tasks.append(task)
        self.started = True
        return self

    async def _on_compute_thread(self, fn) -> None:
        """``fn()`` where forwards run: the compute thread, or here on the loop with ``inline_compute``."""
        if self._executor is None:
            fn()
        else:
            await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def _open_trace(self) -> None:
        self.tracer = None
        if self.config.trace:
            from nightjar.kernel.trace import TraceWriter

            self.tracer = TraceWriter(self.config.trace, self.trace_header(), max_bytes=self.config.trace_max_bytes)
            self.bus.add_tap(self.tracer.write)

    def control_spec(self) -> ControlSpec:
        """The typed values the control plane is built from (also the core of the trace header)."""
        m, tc = self.memory, self.target.config
        return ControlSpec(config=self.config, vocab_size=tc.vocab_size, num_blocks=m.num_blocks,
                           eos_token_ids=tuple(tc.eos_token_ids), max_position=tc.max_position,
                           draft=self._draft_identity(), draft_bytes=m.draft_footprint,
                           draft_blocks=m.draft_footprint // m.block_bytes, planner_profile=self._planner_profile)

    def _draft_identity(self) -> str | None:
        """The drafter as the control plane and traces name it: a model's source, ``ngram:MIN-MAX``, or None."""
        if self.ngram is not None:
            return f"ngram:{self.ngram[0]}-{self.ngram[1]}"
        return str(self.draft.source) if self.draft else None

    @property
    def ngram(self) -> tuple[int, int] | None:
        """(min_n, max_n) when the engine drafts with the n-gram drafter (actors/draft_ngram.py), else None."""
        return None if self.config.policy == "off" else parse_ngram(self.config.draft)

    def trace_header(self) -> dict:
        """What a trace needs to re-drive the control plane (the ControlSpec) plus model identities."""
        return {**self.control_spec().header(), "draft_num_blocks": self.memory.draft_num_blocks,
                "target": str(self.target.source), "torch": torch.__version__}

    def _on_actor_done(self, task: asyncio.Task) -> None:
        if task.cancelled() or self._error is not None:
            return
        exc = task.exception()
        self._error = exc or EngineError(f"{task.get_name()} exited")
        log.error("engine stopped: %s", self._error)
        self._fail_all(EngineError(f"engine stopped: {self._error}"))
        for t in self._tasks:
            t.cancel()

    def _fail_all(self, err: Exception) -> None:
        for q in self.collector.queues.values():
            q.put_nowait(err)

    async def stop(self) -> None:
        if not self.started:
            return
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._error is None:
            self._error = EngineError("engine is shut down")
            self._fail_all(self._error)
        if self.weights.transfer is not None:     # a copy in flight finishes first
            self.weights.transfer.shutdown()
            await self._on_compute_thread(self.weights.restore_now)
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        for loaded in (self.target, self.draft):
            if loaded is not None:
                detach_graphs(loaded.model)      # frees the graphs' memory; the models may serve another engine
        if self.tracer is not None:
            self.bus.remove_tap(self.tracer.write)
            self.tracer.close(handled={a.name: a.last_seq for a in self.actors})
        self.started = False

    async def __aenter__(self) -> "Engine":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    @property
    def healthy(self) -> bool:
        return self.started and self._error is None

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt: str | list[dict] | list[int]) -> list[int]:
        """Chat messages go through the chat template; a string is a raw prompt; ints pass through."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special=True)
        if prompt and isinstance(prompt[0], dict):
            return self.tokenizer.encode_chat(list(prompt))
        return [int(t) for t in prompt]

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: int | None = None,
                       speculate: bool = True) -> AsyncIterator[RequestOutput]:
        if not self.healthy:
            raise EngineError(f"engine is not running: {self._error}" if self._error else "engine is not started")
        params = params or SamplingParams()
        ids = self.encode(prompt)
        rid = next(self._ids) if request_id is None else request_id
        if rid in self.collector.live:
            raise RequestError(f"request id {rid} is already in flight", status=400)
        q: asyncio.Queue = asyncio.Queue()
        self.collector.queues[rid] = q
        self.collector.live.add(rid)
        try:
            self.bus.publish("client", [SubmitRequest(req_id=rid, prompt_ids=tuple(ids), sampling=params.to_spec(),
                                                      speculate=speculate)])
            async for out in self._stream(rid, q, params, len(ids)):
                yield out
        finally:
            self.collector.queues.pop(rid, None)

    async def _stream(self, rid: int, q: asyncio.Queue, params: SamplingParams, n_prompt: int):
        text = IncrementalText(self.tokenizer, params.stop)
        n_out, finished = 0, False
        try:
            while not finished:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                toks, fin, _ = item
                if text.stopped:
                    continue
                finished = fin != FinishReason.NONE
                delta = text.push(toks, final=finished)
                n_out += len(toks)
                reason = fin.label
                if text.stopped and not finished:
                    self.bus.publish("client", [AbortRequest(req_id=rid, reason=FinishReason.STOP)])
                    finished, reason = True, "stop"
                yield RequestOutput(rid, delta, toks, text.text, reason, n_prompt, n_out)
        finally:
            if not finished and self.healthy:
                self.bus.publish("client", [AbortRequest(req_id=rid)])

    async def abort(self, request_id: int) -> None:
        self.bus.publish("client", [AbortRequest(req_id=request_id)])

    @property
    def stats(self) -> EngineStats:
        return self.collector.stats


async def _collect(engine: Engine, prompt, params: SamplingParams) -> RequestOutput:
    last, ids = None, []
    async for out in engine.generate(prompt, params):
        ids.extend(out.token_ids)
        last = out
    last.token_ids = ids
    return last


def generate(prompt, params: SamplingParams | None = None, **engine_kwargs) -> RequestOutput:
    """Blocking convenience for scripts: start an engine, generate once, stop (forwards on this thread: one
    request, so no compute thread unless ``inline_compute=False``)."""
    engine_kwargs.setdefault("inline_compute", True)

    async def main():
        async with Engine(**engine_kwargs) as engine:
            return await _collect(engine, prompt, params or SamplingParams())
    return asyncio.run(main())
