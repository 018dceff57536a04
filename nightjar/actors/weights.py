"""Weight mover: owns where the draft's weights (and its KV cache) live, and the elastic-memory
triggers (with hysteresis) that move them.

States (algorithm reference §3): RESIDENT -> OFFLOADING -> OFFLOADED (pool expanded) -> SHRINKING
-> RELOADING -> RESIDENT. γ > 0 only while RESIDENT: every change is announced by DraftResidency.
Transfers run on the transfer worker; their completion comes back as a TransferFinished message. In the
engine an offload's copy starts only once the draft executor has answered DraftResidency(OFFLOADING) with
DraftQuiesced: a draft head writes its cache in γ = 0 steps too (the features of the steps before), and a
write racing the release stopped the engine (tests/actors/test_draft_head.py).

The reload is always reachable: its headroom is capped by the base pool (an empty pool always
qualifies), and an engine with no request in flight reloads at once (no steps run to persist over).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

from nightjar.kernel.actor import Actor
from nightjar.kernel.messages import (
    BlocksReserved,
    DraftOffloaded,
    DraftQuiesced,
    DraftReloaded,
    DraftResidency,
    GrowPool,
    OffloadDraft,
    PoolResized,
    ReloadDraft,
    RequestAdmitted,
    ShrinkPool,
    StepScheduled,
    StepVerified,
    TokensCommitted,
    TransferFinished,
)

log = logging.getLogger(__name__)
MAX_COPY_FAILURES = 3


@dataclass
class DraftSlot:
    """The draft model and its KV cache; the weight mover swaps their storage between device and host."""
    model: object                      # torch.nn.Module (torch is not imported here: the simulator)
    cache: object
    device: object                     # torch.device

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes()


@dataclass
class Triggers:
    """Hysteresis thresholds: τ_low as a fraction of the pool, T_persist steps, block headroom."""
    draft_blocks: int
    low_free_frac: float = 0.10
    persist_steps: int = 3
    headroom_blocks: int = 0
    offload_on_queue: bool = True      # a waiting request counts as KV pressure too (else τ_low alone)

    def wants_offload(self, gamma: int, free: int, total: int, waiting: int, to_finish: int = -1) -> bool:
        """γ = 0 and KV short: fewer than τ_low free blocks, or a request waiting (``offload_on_queue``), while
        the running and waiting requests may still need more blocks than are free (``to_finish``; -1 =
        unknown: the thresholds alone). When every request's max_len fits, the draft's blocks buy nothing:
        requests that wait for the prefill budget cycled the draft on an H200 and halved throughput at
        B = 32-64 (docs/benchmarks.md)."""
        short = free < self.low_free_frac * total or (self.offload_on_queue and waiting > 0)
        return gamma == 0 and short and (to_finish < 0 or to_finish > free)

    def wants_reload(self, free: int, total: int, waiting: int) -> bool:
        base = total - self.draft_blocks                   # the pool once the draft is back
        room = self.draft_blocks + self.low_free_frac * base + self.reload_headroom(base)
        return waiting == 0 and free > room

    def reload_headroom(self, base: int) -> float:
        """The configured headroom, capped at half of what τ_low leaves of the base pool: with the cap,
        a pool with at most that half in use (an empty one always) qualifies, whatever the limits."""
        return min(self.headroom_blocks, max(0.0, (1.0 - self.low_free_frac) * base / 2))


class WeightMover(Actor):
    name: ClassVar[str] = "weights"
    subscribes = (StepScheduled, BlocksReserved, StepVerified, TransferFinished, PoolResized,
                  OffloadDraft, ReloadDraft, RequestAdmitted, TokensCommitted, DraftQuiesced)
    quiet = (StepScheduled, RequestAdmitted, BlocksReserved, StepVerified, TokensCommitted)    # stays_quiet

    def __init__(self, slot: DraftSlot | None, triggers: Triggers | None, elastic: bool, transfer=None):
        super().__init__()
        self.slot, self.triggers, self.transfer = slot, triggers, transfer
        self.elastic = elastic and slot is not None and triggers is not None and triggers.draft_blocks > 0
        self.state = "RESIDENT" if slot is not None else "NONE"
        self.streak = 0
        self.waiting = 0
        self.to_finish = -1              # StepScheduled.blocks_to_finish
        self.gamma_inflight = 0
        self.host = None                 # the draft's host copy while offloaded
        self.offload_done = False
        self.num_offloads = self.num_reloads = 0
        self.reload_forced = False       # a ReloadDraft command retries every step until the pool shrinks
        self.live: set[int] = set()      # requests admitted and not finished: none left -> reload at once
        self.copy_failures = 0           # failed transfers in a row (MAX_COPY_FAILURES turns elastic memory off)
        self.await_quiesced = False      # a live draft executor: copy out only after its DraftQuiesced
        self.copying = False             # this offload's copy has started

    def on_start(self, now):
        return [DraftResidency(resident=self.slot is not None, state=self.state)]

    def stays_quiet(self, msg) -> bool:
        """StepScheduled and RequestAdmitted only feed later decisions. Without elastic memory and no command
        moving the draft, nothing else in a step can start anything either; with it, a StepVerified can only
        finish an offload under way and a TokensCommitted only bring back an offloaded draft, while every
        BlocksReserved is weighed at once."""
        if isinstance(msg, (StepScheduled, RequestAdmitted)):
            return True
        if not self.elastic and self.state in ("NONE", "RESIDENT"):
            return True
        if isinstance(msg, StepVerified):
            return self.state != "OFFLOADING"
        if isinstance(msg, TokensCommitted):
            return self.state != "OFFLOADED"
        return False

    def handle(self, msg, now):
        match msg:
            case StepScheduled():
                self.waiting, self.to_finish = msg.num_waiting, msg.blocks_to_finish
            case RequestAdmitted():
                self.live.add(msg.req_id)
            case TokensCommitted():
                self.live.difference_update(r for r, f in zip(msg.req_ids, msg.finish) if f)
                return self._reload_if_idle()
            case BlocksReserved():
                self.gamma_inflight = msg.gamma
                return self._evaluate(msg)
            case StepVerified():
                self.gamma_inflight = 0
                return self._finish_offload() if self.offload_done else None
            case OffloadDraft() if self.state == "RESIDENT":
                return self._start_offload()
            case DraftQuiesced() if self.state == "OFFLOADING" and not self.copying:
                self._copy_out()
            case ReloadDraft() if self.state == "OFFLOADED":
                self.reload_forced = True
                return self._start_shrink()
            case TransferFinished():
                return self._transfer_finished(msg)
            case PoolResized() if self.state == "SHRINKING" and msg.delta <= 0:
                return self._shrunk(msg)
        return None

    # ---- triggers ------------------------------------------------------------------------------
    def _evaluate(self, r: BlocksReserved):
        if self.reload_forced and self.state == "OFFLOADED":
            return self._start_shrink()
        if not self.elastic or self.state not in ("RESIDENT", "OFFLOADED"):
            return None
        t = self.triggers
        if self.state == "RESIDENT":
            hit = t.wants_offload(r.gamma, r.num_free, r.num_total, self.waiting, self.to_finish)
        else:
            hit = t.wants_reload(r.num_free, r.num_total, self.waiting)
        self.streak = self.streak + 1 if hit else 0
        if self.streak < t.persist_steps:
            return None
        self.streak = 0
        return self._start_offload() if self.state == "RESIDENT" else self._start_shrink()

    def _reload_if_idle(self):
        """No request in flight: the pool is all free, so an offloaded draft comes back now."""
        if self.live or not self.elastic or self.state != "OFFLOADED":
            return None
        self.streak = 0
        return self._start_shrink()

    # ---- offload: copy out, then (between γ>0 steps) release and grow the pool ------------------
    def _start_offload(self):
        """Announce the offload; the copy starts now, or with a live draft executor (``await_quiesced``) once
        it has said it no longer touches the draft (DraftQuiesced): a draft head writes its cache after every
        verified step, not only in γ > 0 steps, and must not race the copy or the release."""
        self.state, self.offload_done, self.copying = "OFFLOADING", False, False
        if not self.await_quiesced:
            self._copy_out()
        return [DraftResidency(resident=False, state=self.state)]

    def _copy_out(self) -> None:
        self.copying = True
        if self.transfer is not None:
            self.transfer.offload(self.slot, self._offload_copied)

    def _offload_copied(self, host, seconds: float) -> None:
        """Runs on the event loop when the copy to host is done (live engines only)."""
        self.host = host
        self.bus.publish("transfer", [TransferFinished(kind="offload", nbytes=host.nbytes, duration_s=seconds)])

    def copy_failed(self, kind: str, err: BaseException, seconds: float) -> None:
        """Runs on the event loop when the transfer worker's copy raised (DraftTransfer's ``failed``)."""
        self.bus.publish("transfer", [TransferFinished(kind=kind, nbytes=0, duration_s=seconds,
                                                       error=f"{type(err).__name__}: {err}")])

    def _transfer_failed(self, msg: TransferFinished):
        """A copy raised. Offload: nothing was released yet, so the draft stays resident. Reload: the host
        copy is intact, so the draft stays offloaded and the pool grows back into its blocks."""
        log.error("draft %s failed after %.3f s: %s", msg.kind, msg.duration_s, msg.error)
        self.copy_failures += 1
        if self.copy_failures >= MAX_COPY_FAILURES and self.elastic:
            self.elastic = False                 # no retry loop: the triggers stop; commands still work
            log.error("elastic draft memory is off after %d failed copies in a row", self.copy_failures)
        if msg.kind == "offload" and self.state == "OFFLOADING":
            self.state, self.offload_done = "RESIDENT", False
            return [DraftResidency(resident=True, state=self.state)]
        if msg.kind == "reload" and self.state == "RELOADING":
            self.state = "OFFLOADED"
            return [DraftResidency(resident=False, state=self.state), GrowPool(num_blocks=self.triggers.draft_blocks)]
        return None

    def _transfer_finished(self, msg: TransferFinished):
        if msg.error:
            return self._transfer_failed(msg)
        self.copy_failures = 0
        if msg.kind == "offload" and self.state == "OFFLOADING":
            self.offload_done, self.offload_info = True, msg
            return self._finish_offload() if self.gamma_inflight == 0 else None
        if msg.kind == "reload" and self.state == "RELOADING":
            self.state, self.host = "RESIDENT", None
            self.num_reloads += 1
            return [DraftReloaded(bytes_moved=msg.nbytes, duration_s=msg.duration_s),
                    DraftResidency(resident=True, state=self.state)]
        return None

    def _finish_offload(self):
        from nightjar.transfer.weights import release_draft

        if self.slot is not None and self.transfer is not None:
            release_draft(self.slot)
        self.state, self.offload_done = "OFFLOADED", False
        self.num_offloads += 1
        n, info = self.triggers.draft_blocks, self.offload_info
        return [DraftOffloaded(bytes_moved=info.nbytes, duration_s=info.duration_s, freed_blocks=n),
                DraftResidency(resident=False, state=self.state), GrowPool(num_blocks=n)] \
            + (self._reload_if_idle() or [])

    # ---- reload: shrink the pool first, then copy back ----------------------------------------
    def _start_shrink(self):
        self.state = "SHRINKING"
        return [ShrinkPool(num_blocks=self.triggers.draft_blocks), DraftResidency(resident=False, state=self.state)]

    def _shrunk(self, msg: PoolResized):
        if msg.delta == 0:                 # the pool could not shrink yet: stay expanded
            self.state = "OFFLOADED"
            return [DraftResidency(resident=False, state=self.state)]
        self.state, self.reload_forced = "RELOADING", False
        if self.transfer is not None:
            self.transfer.reload(self.slot, self.host, self._reload_copied)
        return [DraftResidency(resident=False, state=self.state)]

    def restore_now(self) -> None:
        """At shutdown: put an offloaded draft back (synchronously) so its model object stays usable."""
        if self.host is not None and self.state in ("OFFLOADED", "SHRINKING", "RELOADING"):
            self.transfer._reload(self.slot, self.host)
        self.host, self.state = None, "RESIDENT"

    def _reload_copied(self, nbytes: int, seconds: float) -> None:
        self.bus.publish("transfer", [TransferFinished(kind="reload", nbytes=nbytes, duration_s=seconds)])
