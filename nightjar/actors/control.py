"""Build the control-plane actors (admission, batcher, planner, KV pool, weight mover) from a trace
header, without models or torch tensors: one place for their constructor arguments."""
from __future__ import annotations

from typing import Any, Callable

from nightjar.kernel.actor import Actor
from nightjar.kernel.config import EngineConfig

CONTROL_ACTORS = ("admission", "batcher", "planner", "kv", "weights")


class _NoModel:
    def parameters(self):
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


def max_len(header: dict[str, Any], cfg: EngineConfig) -> int:
    return min(cfg.max_model_len, int(header.get("max_position") or cfg.max_model_len))


def _admission(h, c):
    from nightjar.actors.admission import Admission
    return Admission(int(h["vocab_size"]), max_len(h, c), c.max_queue, int(h["num_blocks"]) * c.block_size)


def _batcher(h, c):
    from nightjar.actors.batcher import Batcher
    return Batcher(int(h["num_blocks"]), c.block_size, tuple(h.get("eos_token_ids") or ()), c.max_num_seqs,
                   c.max_num_batched_tokens, max_len(h, c))


def _planner(h, c):
    from nightjar.actors.planner import Planner
    draft_blocks = int(h.get("draft_blocks", h.get("draft_blocks_hint", 0)) or 0)
    prof = h.get("planner_profile") or {}          # the step-time model the recorded planner used, if any
    return Planner(c.policy, c.gamma_max, c.seed, h.get("draft") is not None, draft_blocks=draft_blocks,
                   max_batch=c.max_num_seqs, profile=prof.get("profile"), profile_scale=prof.get("scale", 1.0))


def _kv(h, c):
    from nightjar.actors.kv import KVPoolActor
    from nightjar.kvpool.blocks import BlockAllocator
    return KVPoolActor(BlockAllocator(int(h["num_blocks"]), c.block_size))


def elastic_enabled(c: EngineConfig) -> bool:
    from nightjar.actors.policies import make_policy
    return c.elastic_memory if c.elastic_memory is not None else make_policy(c.policy, c.gamma_max).elastic_memory


def triggers_of(h, c: EngineConfig):
    """The weight mover's hysteresis thresholds, as Engine._triggers builds them (draft_blocks from the
    header's ``draft_blocks``, else ``draft_blocks_hint``, else 0: elastic memory off)."""
    from nightjar.actors.weights import Triggers
    headroom = 2 * c.max_num_seqs + c.max_num_batched_tokens // c.block_size
    n = h.get("draft_blocks", h.get("draft_blocks_hint", 0)) or 0
    return Triggers(draft_blocks=int(n), low_free_frac=c.low_free_frac, persist_steps=c.persist_steps,
                    headroom_blocks=headroom, offload_on_queue=c.offload_on_queue)


def _weights(h, c):
    from nightjar.actors.weights import WeightMover
    slot = StubSlot(int(h.get("draft_bytes") or 0)) if h.get("draft") is not None else None
    return WeightMover(slot, triggers_of(h, c), elastic_enabled(c))      # transfer=None: no tensors move


FACTORIES: dict[str, Callable[[dict, EngineConfig], Actor]] = {
    "admission": _admission, "batcher": _batcher, "planner": _planner, "kv": _kv, "weights": _weights,
}


def build_control_actors(header: dict[str, Any], names=CONTROL_ACTORS) -> tuple[dict[str, Actor], dict[str, str]]:
    """({name: actor}, {name: why it could not be built}) for the requested control actors."""
    cfg = header_config(header)
    built, failed = {}, {}
    for name in names:
        try:
            built[name] = FACTORIES[name](header, cfg)
        except Exception as e:      # a constructor that needs more than a header: that actor is an oracle
            failed[name] = f"{type(e).__name__}: {e}"
    return built, failed
