"""Actor base: mailbox loop -> synchronous ``handle(msg, now)`` returning outputs -> publish once.

Relay: an actor may name another (``relay_to``) that takes some of its outputs in the same call, on the same
thread, when that actor says it is ready for one (``accepts_relay``): a blocking actor's message to the next
blocking actor then skips the two hops through the event loop (compute thread -> loop -> compute thread).
The relaying actor may take back, the same way, outputs of the relayed one that it accepts (``accepts_relay``):
a draft executor hands its drafts to the verifier and takes the verifier's StepVerified in the same call (three
stages at most: relaying actor, relayed actor, relaying actor). Everything is still published, in the order the
actors would have published it (each stage's outputs after the previous stage's), under each actor's own name,
and a relayed message is not posted to the mailbox of the actor that has handled it.

Quiet messages: an actor may name subscribed types (``quiet``) that do not wake it when ``stays_quiet(msg)``
says so (by default always): they wait in its mailbox and are handled, in order, with the next message that
wakes it. Only for messages whose handling outputs nothing and whose effect no one needs before a waking
message comes: each wake-up is a task switch, and for a blocking actor a job on the compute thread.
``stays_quiet`` runs on the event loop at publish, so a blocking actor's may read only the message and
state settled before it was published (the head executor's reads whether the verifier put the step's features).

Crash-only: an exception in ``handle`` ends the actor's task, and the supervisor stops the engine.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import ClassVar

from nightjar.kernel.bus import Bus, Envelope, Mailbox
from nightjar.kernel.messages import Msg


class ActorError(RuntimeError):
    def __init__(self, actor: str, cause: BaseException):
        super().__init__(f"actor {actor!r} failed: {type(cause).__name__}: {cause}")
        self.actor, self.cause = actor, cause


@dataclass(slots=True)
class Stage:
    """One actor's outputs in a relayed call; ``taken``: the indices of those the next stage's actor handled."""
    actor: Actor
    out: list[Msg]
    taken: list[int] = field(default_factory=list)


class Actor:
    name: ClassVar[str] = "actor"
    subscribes: ClassVar[tuple[type, ...]] = ()
    blocking: ClassVar[bool] = False        # run handle() in the compute thread (model actors)
    relay_to: Actor | None = None           # takes the outputs it accepts in the same call (module docstring)
    quiet: ClassVar[tuple[type, ...]] = ()  # subscribed types that may wait without waking it (module docstring)

    def __init__(self) -> None:
        self.mailbox = Mailbox()

    def attach(self, bus: Bus) -> None:
        self.bus = bus
        for t in self.subscribes:
            bus.subscribe(t, self.mailbox, self.stays_quiet if t in self.quiet else None)

    def stays_quiet(self, msg: Msg) -> bool:
        """May ``msg``, of a ``quiet`` type, wait in the mailbox without waking this actor (module docstring)?"""
        return True

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

    def _handle_and_relay(self, envs: list[Envelope]) -> list[Stage]:
        """handle_batch, then the relay target's outputs for each output it accepts, then this actor's own for
        each of those it takes back (module docstring): one Stage per actor that ran, in order."""
        stages = [Stage(self, self.handle_batch(envs))]
        to = self.relay_to
        while to is not None and len(stages) < 3:         # this actor -> relay_to -> this actor, at most
            cur, nxt = stages[-1], Stage(to, [])
            for i, msg in enumerate(cur.out):
                if to.accepts_relay(msg):
                    cur.taken.append(i)
                    try:
                        nxt.out.extend(to.handle(msg, self.bus.clock.now()) or [])
                    except Exception as e:
                        raise ActorError(to.name, e) from e
            if not cur.taken:
                break
            stages.append(nxt)
            to = cur.actor
        return stages

    def _publish(self, stages: list[Stage]) -> None:
        for cur, nxt in zip(stages, stages[1:] + [None]):
            if nxt is None:
                self.bus.publish(cur.actor.name, cur.out)
                continue
            taken = set(cur.taken)
            for i, msg in enumerate(cur.out):
                self.bus.publish(cur.actor.name, (msg,), skip=nxt.actor.mailbox if i in taken else None)
                if i in taken:
                    nxt.actor.last_seq = self.bus.seq       # the relayed message's envelope (trace footers)

    async def run(self, executor: Executor | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.bus.publish(self.name, self.on_start(self.bus.clock.now()))
        while True:
            envs = await self.mailbox.get_all()
            try:
                if self.blocking and executor is not None:
                    stages = await loop.run_in_executor(executor, self._handle_and_relay, envs)
                else:
                    stages = self._handle_and_relay(envs)
            except ActorError:
                raise
            except Exception as e:  # crash-only: the supervisor stops everything
                raise ActorError(self.name, e) from e
            self._publish(stages)
