"""Build the control-plane actors (admission, batcher, planner, KV pool, weight mover) from typed values,
without models or torch tensors: one place for their constructor arguments. The engine, the simulator and
replay (which decodes its trace header first, ``spec_from_header``) all build them from a ControlSpec."""
from __future__ import annotations

from typing import Any, Callable

import msgspec

from nightjar.kernel.actor import Actor
from nightjar.kernel.config import EngineConfig

CONTROL_ACTORS = ("admission", "batcher", "planner", "kv", "weights")


class ControlSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The engine config plus the sizes the engine measured: all the control plane is built from."""
    config: EngineConfig
    vocab_size: int
    num_blocks: int                          # target KV pool with the draft resident
    eos_token_ids: tuple[int, ...] = ()
    max_position: int | None = None          # the target's positional limit
    draft: str | None = None                 # the draft's identity (None: no draft)
    draft_bytes: int = 0                     # the draft's device footprint (weights + KV)
    draft_blocks: int = 0                    # KV blocks that footprint buys (0: elastic memory off)
    planner_profile: dict | None = None      # {"profile": step-time model JSON, "scale": float}

    @property
    def max_len(self) -> int:
        return min(self.config.max_model_len, self.max_position or self.config.max_model_len)

    def header(self) -> dict[str, Any]:
        """The trace-header form (``spec_from_header`` reads it back)."""
        out = msgspec.to_builtins(self)
        out["eos_token_ids"] = list(self.eos_token_ids)
        return {k: v for k, v in out.items() if v is not None or k == "draft"}


class _NoModel:
    def parameters(self):
        return iter(())

    def modules(self):                   # release_draft looks for packed layers to drop: there are none
        return iter(())


class _NoCache:
    nbytes = 0

    def release(self) -> int:
        return 0


class StubSlot:
    """Stands in for ``DraftSlot`` where no model exists (replay, simulation): only its size; releasing
    its (absent) tensors is a no-op."""

    def __init__(self, weight_bytes: int = 0) -> None:
        self.weight_bytes, self.model, self.cache, self.device = weight_bytes, _NoModel(), _NoCache(), "cpu"


def header_config(header: dict[str, Any]) -> EngineConfig:
    """The recorded EngineConfig (unknown keys from newer builds are dropped, missing ones default)."""
    cfg = dict(header.get("config") or {})
    known = set(EngineConfig.__struct_fields__)
    return EngineConfig(**{k: v for k, v in cfg.items() if k in known})


def spec_from_header(header: dict[str, Any]) -> ControlSpec:
    """Decode a trace header (older ones too: ``draft_blocks_hint``, missing keys) into a ControlSpec."""
    return ControlSpec(
        config=header_config(header), vocab_size=int(header["vocab_size"]), num_blocks=int(header["num_blocks"]),
        eos_token_ids=tuple(header.get("eos_token_ids") or ()), max_position=header.get("max_position"),
        draft=header.get("draft"), draft_bytes=int(header.get("draft_bytes") or 0),
        draft_blocks=int(header.get("draft_blocks", header.get("draft_blocks_hint", 0)) or 0),
        planner_profile=header.get("planner_profile"))


def tree_scratch_blocks(s: ControlSpec) -> int:
    """Target KV blocks the KV pool holds for sibling rows (2 per sibling: actors/kv.py), 0 without a tree."""
    c = s.config
    return 2 * c.draft_tree * c.draft_tree_batch if s.draft is not None and c.draft_tree > 0 else 0


def _admission(s: ControlSpec):
    from nightjar.actors.admission import Admission
    return Admission(s.vocab_size, s.max_len, s.config.max_queue, s.num_blocks * s.config.block_size)


def _batcher(s: ControlSpec):
    from nightjar.actors.batcher import Batcher
    c = s.config
    return Batcher(s.num_blocks - tree_scratch_blocks(s), c.block_size, s.eos_token_ids, c.max_num_seqs,
                   c.max_num_batched_tokens, s.max_len)


def _planner(s: ControlSpec):
    from nightjar.actors.planner import Planner
    c, prof = s.config, s.planner_profile or {}        # the step-time model the planner uses, if any
    return Planner(c.policy, c.gamma_max, c.seed, s.draft is not None, draft_blocks=s.draft_blocks,
                   max_batch=c.max_num_seqs, profile=prof.get("profile"), profile_scale=prof.get("scale", 1.0))


def _kv(s: ControlSpec):
    from nightjar.actors.kv import KVPoolActor
    from nightjar.kvpool.blocks import BlockAllocator
    alloc = BlockAllocator(s.num_blocks, s.config.block_size)
    return KVPoolActor(alloc, scratch_blocks=tree_scratch_blocks(s))


def elastic_enabled(c: EngineConfig) -> bool:
    from nightjar.actors.policy_factory import make_policy
    return c.elastic_memory if c.elastic_memory is not None else make_policy(c.policy, c.gamma_max).elastic_memory


def triggers_of(draft_blocks: int, c: EngineConfig):
    """The weight mover's hysteresis thresholds (``draft_blocks`` 0: elastic memory off)."""
    from nightjar.actors.weights import Triggers
    headroom = 2 * c.max_num_seqs + c.max_num_batched_tokens // c.block_size
    return Triggers(draft_blocks=draft_blocks, low_free_frac=c.low_free_frac, persist_steps=c.persist_steps,
                    headroom_blocks=headroom, offload_on_queue=c.offload_on_queue)


def _weights(s: ControlSpec):
    from nightjar.actors.weights import WeightMover
    slot = StubSlot(s.draft_bytes) if s.draft is not None else None
    return WeightMover(slot, triggers_of(s.draft_blocks, s.config), elastic_enabled(s.config))   # no transfer yet


FACTORIES: dict[str, Callable[[ControlSpec], Actor]] = {
    "admission": _admission, "batcher": _batcher, "planner": _planner, "kv": _kv, "weights": _weights,
}


class ControlBuildError(RuntimeError):
    """A control actor could not be built from its spec."""


def build_control_actors(spec: ControlSpec, names=CONTROL_ACTORS) -> dict[str, Actor]:
    """{name: actor} for the requested control actors; any constructor failure is an error."""
    built = {}
    for name in names:
        try:
            built[name] = FACTORIES[name](spec)
        except Exception as e:
            raise ControlBuildError(f"cannot build the {name} actor: {type(e).__name__}: {e}") from e
    return built
