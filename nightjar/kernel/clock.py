"""Clocks: the bus stamps every envelope with one of these, and actors take the time of an event from
its envelope (so replay and simulation see the recorded times). The model actors also time their own
compute with ``time.perf_counter`` (the verifier and draft executor, the KV actor's pool resizes); those
durations travel in messages (StepTimed, StepDrafted, PoolResized), so replay reads them, never a clock."""
from __future__ import annotations

import time


class MonotonicClock:
    """Live time: seconds since the clock was made."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._t0


class VirtualClock:
    """Time that moves only when told to (tests, replay, simulation)."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def set(self, t: float) -> None:
        self.t = max(self.t, t)
