"""Per-step bus + actor overhead against step time, at B=1 and B=32, with forwards on the compute thread or inline.

    python bench/bus_overhead.py [--model smollm2-135m] [--policy off] [--tokens 64] [--quantization int4]
                                 [--compute thread,serial,inline] [--batches 1,32] [--repeats 3]

Overhead per step = wall time between consecutive StepScheduled envelopes minus the model time the
verifier measured (StepTimed.step_time_s + catch-up). It covers every hand-off of the step
(batcher -> planner -> KV -> draft -> verifier -> batcher), the compute-thread hops and Python glue that the
compute thread waits for. ``thread`` is the default engine (a compute thread; the verifier starts the next γ = 0
step before the loop commits this one, ``run_ahead``), ``serial`` the same without run-ahead, ``inline`` runs
the engine with ``inline_compute`` (forwards on the event loop's thread: no hops). A run-ahead step's measured
time includes what the loop's work running beside it costs it: compare the step periods too.

A last line gives the machine's floor for one of the step's two thread hand-offs: a bare ``run_in_executor``
whose job sleeps as long as a step (no model, no actors), from the job's return to the event loop resuming.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from peers import in_own_process  # bench/peers.py: a fresh spawned process per call

from nightjar.engine import Engine
from nightjar.kernel.messages import StepScheduled, StepTimed
from nightjar.sampling import SamplingParams


async def measure(kw: dict, batch: int, tokens: int) -> tuple[float, float]:
    async with Engine(**kw) as eng:
        sched, timed = {}, {}

        def tap(env):
            if isinstance(env.msg, StepScheduled):
                sched[env.msg.step] = env.t
            elif isinstance(env.msg, StepTimed):
                timed[env.msg.step] = env.msg.step_time_s + env.msg.catchup_time_s
        prompt = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
        await _drain(eng, prompt, batch, 4)               # warm-up
        eng.bus.add_tap(tap)
        await _drain(eng, prompt, batch, tokens)
        steps = sorted(s for s in sched if s + 1 in sched and s in timed)[5:]
        over = [sched[s + 1] - sched[s] - timed[s] for s in steps]
        total = [sched[s + 1] - sched[s] for s in steps]
        return statistics.median(over), statistics.median(total)


def _measure_sync(kw: dict, batch: int, tokens: int) -> tuple[float, float]:
    return asyncio.run(measure(kw, batch, tokens))


async def _drain(eng, prompt, batch, tokens):
    async def one():
        async for _ in eng.generate(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)):
            pass
    await asyncio.gather(*[one() for _ in range(batch)])


async def handoff_floor(step_s: float, n: int = 40) -> float:
    """Median seconds from a one-thread executor job's return to the awaiting coroutine resuming, for jobs
    that sleep ``step_s`` (the loop idles meanwhile, as it does while a forward runs)."""
    loop = asyncio.get_running_loop()

    def job() -> float:
        time.sleep(step_s)
        return time.perf_counter()

    lat = []
    with ThreadPoolExecutor(1) as ex:
        for _ in range(n):
            end = await loop.run_in_executor(ex, job)
            lat.append(time.perf_counter() - end)
    return statistics.median(lat[3:])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--policy", default="off")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--quantization", default="none", choices=("none", "int8", "int4", "w4a8"))
    ap.add_argument("--compute", default="thread", help="comma-separated: thread (the default engine), serial "
                    "(--no-run-ahead), inline (--inline-compute: forwards on the event loop's thread); several are "
                    "run interleaved")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--repeats", type=int, default=1, help="rounds over every (B, compute) pair; medians printed")
    a = ap.parse_args(argv)
    modes = a.compute.split(",")
    if not set(modes) <= {"thread", "serial", "inline"}:
        ap.error(f"--compute takes thread, serial and/or inline, not {a.compute!r}")
    runs: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for _ in range(a.repeats):
        for B in (int(b) for b in a.batches.split(",")):
            for mode in modes:
                kw = dict(model=a.model, policy=a.policy, dtype=a.dtype, quantization=a.quantization,
                          inline_compute=mode == "inline", run_ahead=mode != "serial")
                # each run in a fresh process: an inline engine runs torch on the main thread, and a threaded
                # engine after it in the same process would run beside a second OpenMP team, ~2x slower
                runs.setdefault((B, mode), []).append(in_own_process(_measure_sync, (kw, B, a.tokens)))
    print("| B | compute | overhead/step (µs) | step period (ms) | overhead % | runs (µs) |\n|---|---|---|---|---|---|")
    for (B, mode), rs in runs.items():
        over, total = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
        each = ", ".join(f"{r[0] * 1e6:.0f}" for r in rs)
        print(f"| {B} | {mode} | {over * 1e6:.0f} | {total * 1e3:.1f} | {100 * over / total:.2f} % | {each} |")
    b0 = min(B for B, _ in runs)
    step1 = statistics.median(r[1] for (B, _), rs in runs.items() if B == b0 for r in rs)
    floor = asyncio.run(handoff_floor(step1))
    print(f"\none bare executor hand-off after a {step1 * 1e3:.1f} ms idle job: {floor * 1e6:.0f} µs "
          f"(a threaded step has two: {200 * floor / step1:.2f} % of the smallest batch's step)")


if __name__ == "__main__":
    main()
