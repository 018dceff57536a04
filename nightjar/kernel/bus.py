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


class Mailbox:
    """A deque plus one waiter future: ``post`` is sync and O(1) and wakes only a pending waiter."""

    def __init__(self) -> None:
        self._items: deque[Envelope] = deque()
        self._waiter: asyncio.Future | None = None

    def __len__(self) -> int:
        return len(self._items)

    def post(self, env: Envelope) -> None:
        self._items.append(env)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get_all(self) -> list[Envelope]:
        """Wait for one envelope, then drain everything pending."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items = list(self._items)
        self._items.clear()
        return items


Tap = Callable[[Envelope], None]


class Bus:
    def __init__(self, clock) -> None:
        self.clock = clock
        self.seq = 0
        self._routes: dict[type, list[Mailbox]] = defaultdict(list)
        self._taps: list[Tap] = []

    def subscribe(self, msg_type: type, mailbox: Mailbox) -> None:
        self._routes[msg_type].append(mailbox)

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
            for box in self._routes.get(type(msg), ()):
                if box is not skip:
                    box.post(env)
