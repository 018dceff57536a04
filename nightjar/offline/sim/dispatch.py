"""A synchronous, allocation-light bus for simulation: a FIFO of (actor, msg) plus a timer heap.

Same per-actor semantics as the live bus (each actor sees the messages it subscribes to in publish
order and answers with ``handle(msg, now)``), but no asyncio, no mailboxes and, unless a tap is
attached, no Envelope objects. Virtual time moves only when the FIFO is empty and a timer fires.
"""
from __future__ import annotations

import heapq
from collections import defaultdict, deque
from typing import Any, Callable

from nightjar.kernel.bus import Envelope
from nightjar.kernel.clock import VirtualClock


class SyncBus:
    def __init__(self, clock: VirtualClock | None = None) -> None:
        self.clock = clock or VirtualClock()
        self.seq = 0
        self.routes: dict[type, list[Any]] = defaultdict(list)
        self.queue: deque = deque()
        self.timers: list = []
        self._n = 0
        self.taps: list[Callable[[Envelope], None]] = []
        self.num_handled = 0

    def add(self, actor) -> None:
        """Route the actor's subscriptions to it (``actor.bus`` is this bus, for actors that publish later)."""
        actor.bus = self
        for t in actor.subscribes:
            self.routes[t].append(actor)

    def publish(self, src: str, msgs) -> None:
        if self.taps:
            return self._publish_tapped(src, msgs)
        routes, q = self.routes, self.queue
        seq = self.seq
        for msg in msgs:
            seq += 1
            actors = routes.get(type(msg))
            if actors:
                for actor in actors:
                    q.append((actor, msg))
        self.seq = seq

    def _publish_tapped(self, src: str, msgs) -> None:
        """``publish`` with taps: each message is stamped into an Envelope for them first."""
        routes, q = self.routes, self.queue
        for msg in msgs:
            self.seq += 1
            env = Envelope(self.seq, self.clock.t, src, msg)
            for tap in self.taps:
                tap(env)
            for actor in routes.get(type(msg), ()):
                q.append((actor, msg))

    def at(self, t: float, fn: Callable, *args) -> None:
        """Call ``fn(*args)`` when virtual time reaches ``t``."""
        self._n += 1
        heapq.heappush(self.timers, (t, self._n, fn, args))

    def start(self, actors) -> None:
        for a in actors:
            out = a.on_start(self.clock.t)
            if out:
                self.publish(a.name, out)

    def run(self, until: float | None = None) -> None:
        q, timers, clock, pop, hpop = self.queue, self.timers, self.clock, self.queue.popleft, heapq.heappop
        routes, append = self.routes, self.queue.append
        n = 0
        while True:
            now = clock.t
            while q:
                actor, msg = pop()
                out = actor.handle(msg, now)
                n += 1
                if not out:
                    continue
                if self.taps:
                    self.publish(actor.name, out)
                    continue
                k = 0                               # publish, inlined (no taps: no envelopes)
                for m in out:
                    k += 1
                    actors = routes.get(type(m))
                    if actors:
                        for a in actors:
                            append((a, m))
                self.seq += k
            if not timers or (until is not None and timers[0][0] > until):
                break
            t, _, fn, args = hpop(timers)
            if t > clock.t:
                clock.t = t
            fn(*args)
        self.num_handled += n
