"""Event bus: routes messages by type, stamps envelopes (global seq + clock time), tees to taps."""
from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from typing import Callable, Iterable

import msgspec

from nightjar.kernel.messages import BusMsg, Msg


class Envelope(msgspec.Struct, frozen=True, gc=False):
    seq: int
    t: float
    src: str
    msg: BusMsg


QUIET_LIMIT = 256      # quiet envelopes a mailbox holds before one wakes its actor anyway (bounds the memory)


class Mailbox:
    """A deque plus one waiter future: ``post`` is sync and O(1) and wakes only a pending waiter.

    A quiet post (``wake=False``) queues without waking: the envelope is drained, in order, with the next one
    that wakes (or once ``QUIET_LIMIT`` are pending)."""

    def __init__(self) -> None:
        self._items: deque[Envelope] = deque()
        self._waiter: asyncio.Future | None = None
        self._awake = False             # a waking envelope is pending

    def __len__(self) -> int:
        return len(self._items)

    def post(self, env: Envelope, wake: bool = True) -> None:
        self._items.append(env)
        if not (wake or len(self._items) >= QUIET_LIMIT):
            return
        self._awake = True
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get_all(self) -> list[Envelope]:
        """Wait for a waking envelope, then drain everything pending (quiet ones included)."""
        while not self._awake:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        self._awake = False
        return items


Tap = Callable[[Envelope], None]
Quiet = Callable[[BusMsg], bool]        # True: this message stays quiet in the subscriber's mailbox


class Bus:
    def __init__(self, clock) -> None:
        self.clock = clock
        self.seq = 0
        self._routes: dict[type, list[tuple[Mailbox, Quiet | None]]] = defaultdict(list)
        self._taps: list[Tap] = []

    def subscribe(self, msg_type: type, mailbox: Mailbox, quiet: Quiet | None = None) -> None:
        """Route ``msg_type`` to ``mailbox``; ``quiet``: asked at each publish whether the message may wait
        there without waking its actor (Mailbox)."""
        self._routes[msg_type].append((mailbox, quiet))

    def add_tap(self, tap: Tap) -> None:
        self._taps.append(tap)

    def remove_tap(self, tap: Tap) -> None:
        self._taps.remove(tap)

    def publish(self, src: str, msgs: Iterable[Msg], skip: Mailbox | None = None) -> None:
        """Stamp, tee and route each message; ``skip``: a mailbox that does not get them (an actor that has
        handled them already, by relay: kernel/actor.py)."""
        for msg in msgs:
            self.seq += 1
            env = Envelope(self.seq, self.clock.now(), src, msg)
            for tap in self._taps:
                tap(env)
            for box, quiet in self._routes.get(type(msg), ()):
                if box is not skip:
                    box.post(env, quiet is None or not quiet(msg))
