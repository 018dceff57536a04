"""Actor base: mailbox loop -> synchronous ``handle(msg, now)`` returning outputs -> publish once.

Relay: an actor may name another (``relay_to``) that takes some of its outputs in the same call, on the same
thread, when that actor says it is ready for one (``accepts_relay``): a blocking actor's message to the next
blocking actor then skips the two hops through the event loop (compute thread -> loop -> compute thread).
Everything is still published, in the order the two would have published it (the relaying actor's outputs,
then the relayed actor's), under each actor's own name, and a relayed message is not posted to the mailbox of
the actor that has handled it.

Crash-only: an exception in ``handle`` ends the actor's task, and the supervisor stops the engine.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import ClassVar

from nightjar.kernel.bus import Bus, Envelope, Mailbox
from nightjar.kernel.messages import Msg


class ActorError(RuntimeError):
    def __init__(self, actor: str, cause: BaseException):
        super().__init__(f"actor {actor!r} failed: {type(cause).__name__}: {cause}")
        self.actor, self.cause = actor, cause


class Actor:
    name: ClassVar[str] = "actor"
    subscribes: ClassVar[tuple[type, ...]] = ()
    blocking: ClassVar[bool] = False        # run handle() in the compute thread (model actors)
    relay_to: Actor | None = None           # takes the outputs it accepts in the same call (module docstring)

    def __init__(self) -> None:
        self.mailbox = Mailbox()

    def attach(self, bus: Bus) -> None:
        self.bus = bus
        for t in self.subscribes:
            bus.subscribe(t, self.mailbox)

    def on_start(self, now: float) -> list[Msg]:
        return []

    def handle(self, msg: Msg, now: float) -> list[Msg] | None:
        raise NotImplementedError

    last_seq: int = 0                       # seq of the last envelope handled (trace footers)

    def accepts_relay(self, msg: Msg) -> bool:
        """May ``msg`` be handed to this actor now, ahead of its mailbox (module docstring)? Called on the
        thread its handle runs on, so only when nothing it has not handled yet should come first."""
        return False

    def handle_batch(self, envs: list[Envelope]) -> list[Msg]:
        self.last_seq = envs[-1].seq
        out: list[Msg] = []
        for env in envs:
            res = self.handle(env.msg, env.t)
            if res:
                out.extend(res)
        return out

    def _handle_and_relay(self, envs: list[Envelope]) -> tuple[list[Msg], list[tuple[int, list[Msg]]]]:
        """handle_batch, then the relay target's outputs for each output it accepts: [(index in out, its
        outputs)]."""
        out = self.handle_batch(envs)
        to, relayed = self.relay_to, []
        if to is not None:
            for i, msg in enumerate(out):
                if to.accepts_relay(msg):
                    try:
                        relayed.append((i, to.handle(msg, self.bus.clock.now()) or []))
                    except Exception as e:
                        raise ActorError(to.name, e) from e
        return out, relayed

    def _publish(self, out: list[Msg], relayed: list[tuple[int, list[Msg]]]) -> None:
        if not relayed:
            self.bus.publish(self.name, out)
            return
        to, done = self.relay_to, {i for i, _ in relayed}
        for i, msg in enumerate(out):
            self.bus.publish(self.name, (msg,), skip=to.mailbox if i in done else None)
            if i in done:
                to.last_seq = self.bus.seq                  # the relayed message's envelope (trace footers)
        for _, msgs in relayed:
            self.bus.publish(to.name, msgs)

    async def run(self, executor: Executor | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.bus.publish(self.name, self.on_start(self.bus.clock.now()))
        while True:
            envs = await self.mailbox.get_all()
            try:
                if self.blocking and executor is not None:
                    out, relayed = await loop.run_in_executor(executor, self._handle_and_relay, envs)
                else:
                    out, relayed = self._handle_and_relay(envs)
            except ActorError:
                raise
            except Exception as e:  # crash-only: the supervisor stops everything
                raise ActorError(self.name, e) from e
            self._publish(out, relayed)
