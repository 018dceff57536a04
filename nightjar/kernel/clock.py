"""Clocks: actors read time only from envelopes stamped by the bus with one of these."""
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

    def advance(self, dt: float) -> None:
        self.t += dt

    def set(self, t: float) -> None:
        self.t = max(self.t, t)
