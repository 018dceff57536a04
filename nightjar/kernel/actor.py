"""Actor base: mailbox loop -> synchronous ``handle(msg, now)`` returning outputs -> publish once.

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

    def handle_batch(self, envs: list[Envelope]) -> list[Msg]:
        self.last_seq = envs[-1].seq
        out: list[Msg] = []
        for env in envs:
            res = self.handle(env.msg, env.t)
            if res:
                out.extend(res)
        return out

    async def run(self, executor: Executor | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.bus.publish(self.name, self.on_start(self.bus.clock.now()))
        while True:
            envs = await self.mailbox.get_all()
            try:
                if self.blocking and executor is not None:
                    out = await loop.run_in_executor(executor, self.handle_batch, envs)
                else:
                    out = self.handle_batch(envs)
            except Exception as e:  # crash-only: the supervisor stops everything
                raise ActorError(self.name, e) from e
            self.bus.publish(self.name, out)
