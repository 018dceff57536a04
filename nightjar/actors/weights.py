"""Weight mover: owns where the draft's weights (and its KV cache) live.

Residency states follow the algorithm reference: RESIDENT -> OFFLOADING -> OFFLOADED -> RELOADING -> RESIDENT.
γ > 0 is allowed only while RESIDENT. Transfers never block the event loop: they run on the
transfer worker (CPU thread, or a CUDA side stream with pinned buffers) and report back by message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from nightjar.kernel.actor import Actor
from nightjar.kernel.messages import DraftResidency


@dataclass
class DraftSlot:
    """The draft model and its KV cache; the weight mover swaps their storage between device and host."""
    model: torch.nn.Module
    cache: object
    device: torch.device

    @property
    def weight_bytes(self) -> int:
        return self.model.weight_bytes()


class WeightMover(Actor):
    name: ClassVar[str] = "weights"
    subscribes = ()

    def __init__(self, slot: DraftSlot | None):
        super().__init__()
        self.slot = slot
        self.state = "RESIDENT" if slot is not None else "NONE"

    def on_start(self, now):
        return [DraftResidency(resident=self.slot is not None, state=self.state)]

    def handle(self, msg, now):
        return None
