"""The bus and actor mailboxes (kernel/bus.py, kernel/actor.py) with stub actors, no models.

Routing by exact message type, envelope stamping, taps, mailbox wake-up and draining, per-actor
ordering, one publish per handled batch, crash-only failure (ActorError ends the task), blocking
actors on the compute executor, and shutdown by cancellation.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from nightjar.kernel.actor import Actor, ActorError
from nightjar.kernel.bus import Bus, Envelope, Mailbox
from nightjar.kernel.clock import VirtualClock
from nightjar.kernel.messages import AbortRequest, EngineStopping, ReleaseBlocks, StepPlanned

TIMEOUT = 5.0


def drain(box: Mailbox) -> list[Envelope]:
    """Everything pending in a mailbox, without an event loop."""
    items = list(box._items)
    box._items.clear()
    return items


# ---- bus: routing, stamping, taps ------------------------------------------------------------
def test_publish_routes_each_message_by_type_to_every_subscriber_in_order():
    bus = Bus(VirtualClock(2.5))
    plans, both, aborts = Mailbox(), Mailbox(), Mailbox()
    bus.subscribe(StepPlanned, plans)
    bus.subscribe(StepPlanned, both)
    bus.subscribe(AbortRequest, both)
    bus.subscribe(AbortRequest, aborts)
    msgs = [StepPlanned(step=1, gamma=2), AbortRequest(req_id=7), ReleaseBlocks(req_ids=(3,)),
            StepPlanned(step=2, gamma=0)]
    bus.publish("planner", msgs)

    assert [e.msg for e in drain(plans)] == [msgs[0], msgs[3]]
    assert [e.msg for e in drain(aborts)] == [msgs[1]]
    got = drain(both)
    assert [e.msg for e in got] == [msgs[0], msgs[1], msgs[3]]
    assert [e.seq for e in got] == [1, 2, 4]          # the unsubscribed ReleaseBlocks still took seq 3
    assert {e.src for e in got} == {"planner"} and {e.t for e in got} == {2.5}


def test_seq_is_global_across_publishers_and_t_is_the_clock_at_publish():
    clock = VirtualClock(1.0)
    bus = Bus(clock)
    box = Mailbox()
    bus.subscribe(StepPlanned, box)
    bus.publish("a", [StepPlanned(step=1, gamma=1)])
    clock.set(4.0)
    bus.publish("b", [StepPlanned(step=2, gamma=1), StepPlanned(step=3, gamma=1)])
    bus.publish("c", [])                              # nothing to publish: seq does not move
    assert [(e.seq, e.t, e.src, e.msg.step) for e in drain(box)] == [(1, 1.0, "a", 1), (2, 4.0, "b", 2),
                                                                     (3, 4.0, "b", 3)]
    assert bus.seq == 3


def test_taps_see_every_envelope_even_unrouted_ones_and_stop_after_removal():
    bus = Bus(VirtualClock())
    box = Mailbox()
    bus.subscribe(StepPlanned, box)
    seen: list[Envelope] = []
    order: list[str] = []

    def tap(env):
        seen.append(env)
        order.append(f"tap{env.seq}:{len(box)}")      # the tap runs before the mailboxes get the envelope

    bus.add_tap(tap)
    bus.publish("x", [StepPlanned(step=1, gamma=0), EngineStopping(reason="bye")])
    assert [e.seq for e in seen] == [1, 2] and seen[1].msg == EngineStopping(reason="bye")
    assert order == ["tap1:0", "tap2:1"]
    assert drain(box)[0] is seen[0]                   # the same envelope object, not a copy
    bus.remove_tap(tap)
    bus.publish("x", [StepPlanned(step=2, gamma=0)])
    assert len(seen) == 2 and len(box) == 1
    with pytest.raises(ValueError):
        bus.remove_tap(tap)


# ---- mailbox -------------------------------------------------------------------------------
async def test_get_all_waits_for_a_post_then_drains_everything_pending_in_order():
    box = Mailbox()
    envs = [Envelope(i, 0.0, "s", StepPlanned(step=i, gamma=0)) for i in range(1, 4)]
    getter = asyncio.ensure_future(box.get_all())
    await asyncio.sleep(0)
    assert not getter.done() and box._waiter is not None
    for e in envs:                                    # posts before the getter runs again: one batch
        box.post(e)
    assert await asyncio.wait_for(getter, TIMEOUT) == envs
    assert len(box) == 0 and box._waiter is None
    box.post(envs[0])                                 # already pending: no wait at all
    assert await asyncio.wait_for(box.get_all(), TIMEOUT) == [envs[0]]


async def test_a_cancelled_get_all_leaves_the_mailbox_usable():
    box = Mailbox()
    getter = asyncio.ensure_future(box.get_all())
    await asyncio.sleep(0)
    getter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await getter
    assert box._waiter is None
    env = Envelope(1, 0.0, "s", StepPlanned(step=1, gamma=0))
    box.post(env)                                     # no waiter: nothing to wake, nothing raised
    assert await asyncio.wait_for(box.get_all(), TIMEOUT) == [env]


async def test_a_quiet_post_waits_without_waking_and_is_drained_in_order_with_the_next_that_wakes():
    box = Mailbox()
    envs = [Envelope(i, 0.0, "s", StepPlanned(step=i, gamma=0)) for i in range(1, 4)]
    getter = asyncio.ensure_future(box.get_all())
    await asyncio.sleep(0)
    box.post(envs[0], wake=False)
    box.post(envs[1], wake=False)
    await asyncio.sleep(0.01)
    assert not getter.done() and len(box) == 2        # queued, the waiter still asleep
    box.post(envs[2])
    assert await asyncio.wait_for(getter, TIMEOUT) == envs
    box.post(envs[0], wake=False)                      # nothing that wakes is pending: get_all waits
    getter = asyncio.ensure_future(box.get_all())
    await asyncio.sleep(0.01)
    assert not getter.done()
    getter.cancel()
    await asyncio.gather(getter, return_exceptions=True)


async def test_quiet_posts_wake_the_actor_once_the_limit_is_pending():
    from nightjar.kernel.bus import QUIET_LIMIT

    box = Mailbox()
    getter = asyncio.ensure_future(box.get_all())
    await asyncio.sleep(0)
    for i in range(QUIET_LIMIT - 1):
        box.post(Envelope(i, 0.0, "s", StepPlanned(step=i, gamma=0)), wake=False)
    await asyncio.sleep(0.01)
    assert not getter.done()
    box.post(Envelope(QUIET_LIMIT, 0.0, "s", StepPlanned(step=QUIET_LIMIT, gamma=0)), wake=False)
    assert len(await asyncio.wait_for(getter, TIMEOUT)) == QUIET_LIMIT


def test_a_subscription_s_quiet_predicate_is_asked_per_message():
    bus = Bus(VirtualClock())
    box = Mailbox()
    asked = []
    bus.subscribe(StepPlanned, box, quiet=lambda m: asked.append(m.step) or m.gamma == 0)
    bus.subscribe(AbortRequest, box)
    bus.publish("x", [StepPlanned(step=1, gamma=0)])
    assert len(box) == 1 and not box._awake
    bus.publish("x", [AbortRequest(req_id=3)])         # no predicate: wakes
    assert box._awake and asked == [1]
    drain(box)
    box._awake = False
    bus.publish("x", [StepPlanned(step=2, gamma=2)])
    assert box._awake and asked == [1, 2]


# ---- actors on a live loop --------------------------------------------------------------------
class Recorder(Actor):
    """Records what it handles (message, now, thread) and answers each StepPlanned with a ReleaseBlocks."""
    name = "recorder"
    subscribes = (StepPlanned, AbortRequest)

    def __init__(self, fail_on: int | None = None, gate: threading.Event | None = None):
        super().__init__()
        self.fail_on, self.gate = fail_on, gate
        self.handled: list[tuple[object, float]] = []
        self.threads: set[str] = set()
        self.entered = threading.Event()

    def on_start(self, now):
        return [EngineStopping(reason=f"started at {now}")]

    def handle(self, msg, now):
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(TIMEOUT)
        self.threads.add(threading.current_thread().name)
        self.handled.append((msg, now))
        if isinstance(msg, StepPlanned):
            if msg.step == self.fail_on:
                raise ValueError(f"bad step {msg.step}")
            return [ReleaseBlocks(req_ids=(msg.step,))]
        return None


class BlockingRecorder(Recorder):
    blocking = True


def wired(actor: Actor, t: float = 0.0) -> tuple[Bus, list[Envelope]]:
    bus = Bus(VirtualClock(t))
    out: list[Envelope] = []
    bus.add_tap(out.append)
    actor.attach(bus)
    return bus, out


async def until(cond, what: str) -> None:
    for _ in range(int(TIMEOUT / 0.002)):
        if cond():
            return
        await asyncio.sleep(0.002)
    raise AssertionError(f"timed out waiting for {what}")


async def test_an_actor_handles_in_seq_order_and_publishes_each_batch_once_after_it():
    actor = Recorder()
    bus, seen = wired(actor, t=3.0)
    task = asyncio.ensure_future(actor.run())
    await until(lambda: seen, "on_start output")
    assert seen[0].msg == EngineStopping(reason="started at 3.0") and seen[0].src == "recorder"
    msgs = [StepPlanned(step=1, gamma=0), AbortRequest(req_id=9), StepPlanned(step=2, gamma=0)]
    bus.publish("test", msgs)
    await until(lambda: len(seen) == 6, "two answers")
    assert [m for m, _ in actor.handled] == msgs and {t for _, t in actor.handled} == {3.0}
    # the inputs took seqs 2..4; both answers follow them, in input order, as one publish
    assert [(e.seq, e.src, e.msg) for e in seen[4:]] == [(5, "recorder", ReleaseBlocks(req_ids=(1,))),
                                                        (6, "recorder", ReleaseBlocks(req_ids=(2,)))]
    assert actor.last_seq == 4
    assert actor.threads == {threading.current_thread().name}     # a non-blocking actor runs on the loop
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class QuietRecorder(Recorder):
    """A Recorder whose AbortRequests wait for the next StepPlanned."""
    quiet = (AbortRequest,)
    batches: int = 0

    def handle_batch(self, envs):
        self.batches += 1
        return super().handle_batch(envs)


async def test_an_actor_handles_its_quiet_messages_in_order_with_the_next_that_wakes_it():
    actor = QuietRecorder()
    bus, seen = wired(actor)
    task = asyncio.ensure_future(actor.run())
    await until(lambda: seen, "on_start output")
    bus.publish("test", [AbortRequest(req_id=1)])
    bus.publish("test", [AbortRequest(req_id=2)])
    await asyncio.sleep(0.02)
    assert actor.handled == [] and actor.batches == 0
    bus.publish("test", [StepPlanned(step=3, gamma=0)])
    await until(lambda: actor.handled, "the waking message")
    assert [m for m, _ in actor.handled] == [AbortRequest(req_id=1), AbortRequest(req_id=2),
                                            StepPlanned(step=3, gamma=0)]
    assert actor.batches == 1 and actor.last_seq == 4
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_an_actor_does_not_see_its_own_unsubscribed_outputs_and_chains_through_the_bus():
    a, b = Recorder(), Recorder()
    b.name, b.subscribes = "b", (ReleaseBlocks,)
    b.handle = lambda msg, now: [AbortRequest(req_id=msg.req_ids[0] * 10)]      # b answers a's output
    bus, seen = wired(a)
    b.attach(bus)
    tasks = [asyncio.ensure_future(x.run()) for x in (a, b)]
    bus.publish("test", [StepPlanned(step=4, gamma=0)])
    await until(lambda: len(a.handled) == 2, "a to handle b's AbortRequest")
    assert [m for m, _ in a.handled] == [StepPlanned(step=4, gamma=0), AbortRequest(req_id=40)]
    flow = [(e.src, type(e.msg).__name__) for e in seen if not isinstance(e.msg, EngineStopping)]
    assert flow == [("test", "StepPlanned"), ("recorder", "ReleaseBlocks"), ("b", "AbortRequest")]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_an_exception_in_handle_ends_the_task_with_actor_error_and_publishes_nothing_of_that_batch():
    actor = Recorder(fail_on=2)
    bus, seen = wired(actor)
    task = asyncio.ensure_future(actor.run())
    await until(lambda: seen, "on_start output")
    bus.publish("test", [StepPlanned(step=1, gamma=0), StepPlanned(step=2, gamma=0), StepPlanned(step=3, gamma=0)])
    with pytest.raises(ActorError) as err:
        await asyncio.wait_for(task, TIMEOUT)
    assert err.value.actor == "recorder" and isinstance(err.value.cause, ValueError)
    assert str(err.value) == "actor 'recorder' failed: ValueError: bad step 2"
    assert [m.step for m, _ in actor.handled] == [1, 2]           # step 3 never handled
    assert [type(e.msg) for e in seen] == [EngineStopping, StepPlanned, StepPlanned, StepPlanned]  # no answers
    bus.publish("test", [StepPlanned(step=5, gamma=0)])           # the bus still routes to the dead mailbox
    assert len(actor.mailbox) == 1 and [m.step for m, _ in actor.handled] == [1, 2]


async def test_a_blocking_actor_handles_on_the_executor_thread_and_publishes_on_the_loop():
    actor = BlockingRecorder()
    bus, seen = wired(actor)
    publish_threads: list[str] = []
    bus.add_tap(lambda env: publish_threads.append(threading.current_thread().name))
    with ThreadPoolExecutor(1, thread_name_prefix="test-compute") as ex:
        task = asyncio.ensure_future(actor.run(ex))
        bus.publish("test", [StepPlanned(step=1, gamma=0)])
        await until(lambda: len(seen) == 3, "the answer")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert len(actor.threads) == 1 and actor.threads.pop().startswith("test-compute")
    assert set(publish_threads) == {threading.current_thread().name}
    assert seen[-1].msg == ReleaseBlocks(req_ids=(1,))


async def test_a_blocking_actor_without_an_executor_runs_on_the_loop():
    actor = BlockingRecorder()
    bus, seen = wired(actor)
    task = asyncio.ensure_future(actor.run(None))
    bus.publish("test", [StepPlanned(step=1, gamma=0)])
    await until(lambda: len(seen) == 3, "the answer")
    assert actor.threads == {threading.current_thread().name}
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_cancelling_an_actor_mid_blocking_handle_drops_that_batch_s_outputs():
    gate = threading.Event()
    actor = BlockingRecorder(gate=gate)
    bus, seen = wired(actor)
    with ThreadPoolExecutor(1) as ex:
        task = asyncio.ensure_future(actor.run(ex))
        bus.publish("test", [StepPlanned(step=1, gamma=0)])
        await until(actor.entered.is_set, "handle to start")
        task.cancel()                                              # shutdown while the compute thread works
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
    # the executor finished the handle (shutdown waited for it), but its outputs were never published
    assert [m.step for m, _ in actor.handled] == [1]
    assert sorted(type(e.msg).__name__ for e in seen) == ["EngineStopping", "StepPlanned"]   # no ReleaseBlocks


async def test_a_cancelled_idle_actor_keeps_later_posts_without_handling_them():
    actor = Recorder()
    bus, _ = wired(actor)
    task = asyncio.ensure_future(actor.run())
    await until(lambda: actor.mailbox._waiter is not None, "the actor to wait on its mailbox")
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled() and actor.mailbox._waiter is None
    bus.publish("test", [StepPlanned(step=1, gamma=0)])
    await asyncio.sleep(0.01)
    assert actor.handled == [] and len(actor.mailbox) == 1


# ---- relay: one blocking actor hands an output straight to the next (kernel/actor.py) ----------
class Relayed(BlockingRecorder):
    """Takes ReleaseBlocks (the Recorder's answers) as ``b``; accepts a relay only while ``ready``; answers
    each with an AbortRequest."""
    name = "b"
    subscribes = (ReleaseBlocks,)

    def __init__(self, ready: bool = True, fail: bool = False):
        super().__init__()
        self.ready, self.fail, self.batches = ready, fail, 0

    def accepts_relay(self, msg):
        return self.ready and isinstance(msg, ReleaseBlocks)

    def handle_batch(self, envs):
        self.batches += 1                           # only mailbox deliveries come through here
        return super().handle_batch(envs)

    def handle(self, msg, now):
        self.threads.add(threading.current_thread().name)
        self.handled.append((msg, now))
        if self.fail:
            raise ValueError("relay target failed")
        return [AbortRequest(req_id=msg.req_ids[0] * 10)]


async def relay_run(b: Relayed, steps: int = 1):
    a = BlockingRecorder()
    bus, seen = wired(a)
    b.attach(bus)
    a.relay_to = b
    with ThreadPoolExecutor(1, thread_name_prefix="test-compute") as ex:
        tasks = [asyncio.ensure_future(x.run(ex)) for x in (a, b)]
        bus.publish("test", [StepPlanned(step=s + 1, gamma=0) for s in range(steps)])
        await until(lambda: len(b.handled) == steps or any(t.done() for t in tasks), "b's answers")
        await until(lambda: sum(isinstance(e.msg, AbortRequest) for e in seen) == steps or any(t.done() for t in tasks),
                    "b's answers published")
        for t in tasks:
            t.cancel()
        res = await asyncio.gather(*tasks, return_exceptions=True)
    return a, seen, res


async def test_a_relayed_message_is_handled_in_the_same_job_and_published_in_order_under_each_name():
    b = Relayed()
    a, seen, _ = await relay_run(b)
    flow = [(e.src, type(e.msg).__name__) for e in seen if not isinstance(e.msg, EngineStopping)]
    assert flow == [("test", "StepPlanned"), ("recorder", "ReleaseBlocks"), ("b", "AbortRequest")]
    assert b.batches == 0 and len(b.mailbox) == 0                 # never delivered through b's mailbox
    assert b.threads == a.threads and next(iter(b.threads)).startswith("test-compute")
    assert b.last_seq == next(e.seq for e in seen if isinstance(e.msg, ReleaseBlocks))


async def test_a_target_that_is_not_ready_gets_the_message_through_its_mailbox():
    b = Relayed(ready=False)
    _, seen, _ = await relay_run(b, steps=2)
    assert b.batches >= 1 and [m.req_ids for m, _ in b.handled] == [(1,), (2,)]
    flow = [type(e.msg).__name__ for e in seen if not isinstance(e.msg, EngineStopping)]
    assert flow.count("AbortRequest") == 2


async def test_an_exception_in_the_relay_target_ends_the_task_naming_the_target():
    _, seen, res = await relay_run(Relayed(fail=True))
    err = next(r for r in res if isinstance(r, ActorError))
    assert err.actor == "b" and isinstance(err.cause, ValueError)
    assert not any(isinstance(e.msg, (ReleaseBlocks, AbortRequest)) for e in seen)   # nothing of that batch


class TakesBack(BlockingRecorder):
    """Relays to ``b`` and takes b's AbortRequest answers back in the same job; with ``echo`` it answers each
    with a ReleaseBlocks that ``b`` would accept too (a fourth stage, which the kernel does not run)."""
    def __init__(self, echo: bool = False):
        super().__init__()
        self.echo, self.took = echo, 0

    def accepts_relay(self, msg):
        ok = isinstance(msg, AbortRequest) and not len(self.mailbox)
        self.took += ok
        return ok

    def handle(self, msg, now):
        out = super().handle(msg, now)
        if self.echo and isinstance(msg, AbortRequest):
            self.echo = False                                      # once: b's next answer is not echoed
            return [ReleaseBlocks(req_ids=(msg.req_id,))]
        return out


async def taken_back_run(a: TakesBack, b: Relayed):
    bus, seen = wired(a)
    b.attach(bus)
    a.relay_to = b
    with ThreadPoolExecutor(1, thread_name_prefix="test-compute") as ex:
        tasks = [asyncio.ensure_future(x.run(ex)) for x in (a, b)]
        bus.publish("test", [StepPlanned(step=1, gamma=0)])
        want = 2 if a.echo else 1                                  # read before the echo turns itself off
        await until(lambda: len(b.handled) == want or any(t.done() for t in tasks), "b's answers")
        await until(lambda: sum(isinstance(e.msg, AbortRequest) for e in seen) == want, "b's answers published")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return seen


async def test_the_relaying_actor_takes_back_what_it_accepts_of_the_relayed_actor_s_outputs():
    a, b = TakesBack(), Relayed()
    seen = await taken_back_run(a, b)
    flow = [(e.src, type(e.msg).__name__) for e in seen if not isinstance(e.msg, EngineStopping)]
    assert flow == [("test", "StepPlanned"), ("recorder", "ReleaseBlocks"), ("b", "AbortRequest")]
    assert [type(m).__name__ for m, _ in a.handled] == ["StepPlanned", "AbortRequest"] and a.took == 1
    assert len(a.mailbox) == 0 and b.batches == 0                 # neither went through a mailbox
    assert a.threads == b.threads and next(iter(a.threads)).startswith("test-compute")
    assert a.last_seq == next(e.seq for e in seen if isinstance(e.msg, AbortRequest))


async def test_a_relay_runs_three_stages_at_most_and_the_fourth_goes_through_the_mailbox():
    a, b = TakesBack(echo=True), Relayed()
    seen = await taken_back_run(a, b)
    flow = [(e.src, type(e.msg).__name__) for e in seen if not isinstance(e.msg, EngineStopping)]
    assert flow[:4] == [("test", "StepPlanned"), ("recorder", "ReleaseBlocks"), ("b", "AbortRequest"),
                        ("recorder", "ReleaseBlocks")]
    assert b.batches == 1                                         # the echo reached b through its mailbox
    assert [m.req_ids for m, _ in b.handled] == [(1,), (10,)]
