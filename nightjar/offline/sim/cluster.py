"""Several simulated replicas behind one router, on one virtual clock (``nightjar simulate --replicas N``).

Each replica is a full :class:`~nightjar.offline.simulate.Simulation` (the same control-plane actors, its
own simulated executor and KV pool) on its own :class:`ReplicaBus`; all buses share one clock and one timer
heap, so replicas interleave in virtual time exactly as separate machines would. Requests arrive at the
router, which picks a replica by its policy over the requests it has sent each replica and not yet seen
finish (what a real router such as Ray Serve's knows):

- ``round-robin``: replica ``i mod N``;
- ``least-ongoing``: fewest ongoing requests (ties: the next replica in round-robin order);
- ``p2c``: power of two choices, two distinct replicas drawn at random (seeded), the less loaded one.

With one replica the run is the plain simulation's, event for event.
"""
from __future__ import annotations

import heapq
import random
import time
from dataclasses import dataclass

from nightjar.kernel.clock import VirtualClock
from nightjar.kernel.messages import SamplingSpec, SubmitRequest
from nightjar.offline.sim.dispatch import SyncBus
from nightjar.offline.sim.executors import DEFAULT_ACCEPTANCE
from nightjar.offline.sim.workload import Workload

ROUTERS = ("round-robin", "least-ongoing", "p2c")


class SharedTimers:
    """One clock and one timer heap for every replica's bus (one tie-breaking counter: FIFO at equal t)."""

    def __init__(self) -> None:
        self.clock = VirtualClock()
        self.heap: list = []
        self.n = 0


class ReplicaBus(SyncBus):
    """A replica's bus: its own routes and FIFO, the cluster's clock and timers."""

    def __init__(self, shared: SharedTimers) -> None:
        super().__init__(shared.clock)
        self.shared = shared

    def at(self, t: float, fn, *args) -> None:
        s = self.shared
        s.n += 1
        heapq.heappush(s.heap, (t, s.n, self, fn, args))     # the bus whose FIFO ``fn`` feeds


class Router:
    def __init__(self, policy: str, n: int, seed: int = 0) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)} (got {policy!r})")
        self.policy, self.n = policy, n
        self.ongoing = [0] * n
        self.sent = [0] * n
        self.rng = random.Random(seed)
        self._next = 0

    def pick(self) -> int:
        n, ongoing = self.n, self.ongoing
        if self.policy == "round-robin" or n == 1:
            r = self._next
        elif self.policy == "least-ongoing":
            start = self._next
            r = min(range(n), key=lambda i: (ongoing[i], (i - start) % n))
        else:
            a, b = self.rng.sample(range(n), 2)
            r = a if ongoing[a] <= ongoing[b] else b
        self._next = (r + 1) % n
        ongoing[r] += 1
        self.sent[r] += 1
        return r


@dataclass
class ClusterResult:
    router: str
    policy: str
    replicas: list                     # per-replica SimResult (num_requests: the requests routed to it)
    num_requests: int
    finished: int
    sim_time_s: float
    wall_s: float
    out_tokens: int
    mean_ttft_s: float
    mean_e2e_s: float
    p99_ttft_s: float

    @property
    def throughput(self) -> float:
        return self.out_tokens / self.sim_time_s if self.sim_time_s > 0 else 0.0


class ClusterSimulation:
    def __init__(self, profile, workload: Workload, policy: str, replicas: int, router: str = "round-robin",
                 cfg=None, acceptance=DEFAULT_ACCEPTANCE, local: list[int] | None = None) -> None:
        """``local``: simulate only these replicas (the router still routes every request; the others'
        are dropped). Exact only when routing does not depend on replica state: see :func:`run_cluster`."""
        from nightjar.offline.simulate import SimConfig, Simulation

        if replicas < 1:
            raise ValueError(f"--replicas must be >= 1 (got {replicas})")
        self.cfg = cfg = cfg or SimConfig()
        self.workload, self.policy = workload, policy
        self.shared = SharedTimers()
        self.router = Router(router, replicas, cfg.seed)
        self.sims: list = []
        for r in range(replicas):
            if local is not None and r not in local:
                self.sims.append(None)
                continue
            sim = Simulation(profile, workload, policy, cfg, acceptance)
            self._rebind(sim, ReplicaBus(self.shared), r)
            if r:       # replica 0 keeps the plain simulation's stream: one replica reproduces it exactly
                sim.executor.rng.seed(cfg.seed * 1_000_003 + r)
            self.sims.append(sim)
        self._prompts: dict[int, tuple[int, ...]] = {}
        self._pending: list[ReplicaBus] = []
        self._i = 0

    def _rebind(self, sim, bus: ReplicaBus, r: int) -> None:
        """Move ``sim``'s actors onto ``bus`` and report its finished requests to the router."""
        sim.bus = bus
        sim.actors["weights"].transfer.bus = bus
        for a in [*sim.actors.values(), sim.executor, sim.collector]:
            bus.add(a)
        sim.collector.on_finish = lambda n, r=r: self._finished(r, n)

    def _finished(self, r: int, n: int) -> None:
        self.router.ongoing[r] -= n
        if self.cfg.closed_loop:
            for _ in range(n):
                if self._i < len(self.workload):
                    self._submit()

    def _submit(self) -> None:
        w, i = self.workload, self._i
        n = int(w.prompt_lens[i])
        prompt = self._prompts.get(n) or self._prompts.setdefault(n, (7,) * n)
        sp = SamplingSpec(max_tokens=int(w.output_lens[i]), ignore_eos=True)
        sim = self.sims[self.router.pick()]
        self._i += 1
        if sim is None:                     # another process simulates that replica
            return
        sim.bus.publish("client", [SubmitRequest(req_id=i + 1, prompt_ids=prompt, sampling=sp)])
        self._pending.append(sim.bus)

    def _arrive(self) -> None:
        self._submit()
        if self._i < len(self.workload):
            self.shared_at(float(self.workload.times[self._i]), self._arrive)

    def shared_at(self, t: float, fn) -> None:
        s = self.shared
        s.n += 1
        heapq.heappush(s.heap, (t, s.n, None, fn, ()))

    def run(self) -> ClusterResult:
        t0 = time.perf_counter()
        self.simulate()
        return merge(self.router.policy, self.policy, self.workload, self.cfg, self.partial(time.perf_counter() - t0),
                     time.perf_counter() - t0)

    def simulate(self) -> None:
        sims = [s for s in self.sims if s is not None]
        buses = [s.bus for s in sims]
        for sim in sims:
            sim.bus.start(sim.actors.values())
        if self.cfg.closed_loop:
            self.shared_at(0.0, lambda: [self._submit() for _ in range(min(self.cfg.closed_loop,
                                                                           len(self.workload)))])
        elif len(self.workload):
            self.shared_at(float(self.workload.times[0]), self._arrive)
        heap, clock, pop, pending = self.shared.heap, self.shared.clock, heapq.heappop, self._pending
        for b in buses:
            b.run()                                  # drains its FIFO (its own timer list stays empty)
        while heap:
            t, _, bus, fn, args = pop(heap)
            if t > clock.t:
                clock.t = t
            fn(*args)
            if bus is not None and bus.queue:
                bus.run()
            while pending:                           # buses the router just fed (arrivals, closed loop)
                b = pending.pop()
                if b.queue:
                    b.run()

    def partial(self, wall: float) -> list[tuple]:
        """Per simulated replica: (index, SimResult, TTFTs, E2Es, output tokens, last commit time)."""
        out = []
        for r, sim in enumerate(self.sims):
            if sim is None:
                continue
            res = sim._result(wall)
            res.num_requests = self.router.sent[r]
            c = sim.collector
            done = [q for q in c.done if q in c.arrival]
            out.append((r, res, [c.first[q] - c.arrival[q] for q in done if q in c.first],
                        [c.done[q] - c.arrival[q] for q in done], c.out_tokens, c.t_last))
        return out


def merge(router: str, policy: str, workload: Workload, cfg, parts: list[tuple], wall: float) -> ClusterResult:
    """One ClusterResult from every replica's :meth:`ClusterSimulation.partial` (in replica order)."""
    parts = sorted(parts, key=lambda p: p[0])
    ttft = sorted(x for p in parts for x in p[2])
    e2e = [x for p in parts for x in p[3]]
    t_last = max((p[5] for p in parts), default=0.0)
    t_start = 0.0 if cfg.closed_loop or not len(workload) else float(workload.times[0])
    return ClusterResult(
        router=router, policy=policy, replicas=[p[1] for p in parts], num_requests=len(workload),
        finished=len(e2e), sim_time_s=max(t_last - t_start, 1e-9), wall_s=wall, out_tokens=sum(p[4] for p in parts),
        mean_ttft_s=sum(ttft) / len(ttft) if ttft else float("nan"),
        mean_e2e_s=sum(e2e) / len(e2e) if e2e else float("nan"),
        p99_ttft_s=ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else float("nan"))


def _run_part(args: tuple, local: list[int]) -> list[tuple]:
    sim = ClusterSimulation(*args, local=local)
    t0 = time.perf_counter()
    sim.simulate()
    return sim.partial(time.perf_counter() - t0)


def parallel_ok(router: str, cfg) -> bool:
    """Replicas are independent (so separate processes give the serial run's results exactly) when the
    router ignores their state and no client waits on a finish: round-robin, open loop."""
    return router == "round-robin" and not cfg.closed_loop


def run_cluster(profile, workload: Workload, policy: str, replicas: int, router: str = "round-robin", cfg=None,
                acceptance=DEFAULT_ACCEPTANCE, jobs: int = 1) -> ClusterResult:
    """Serial, or with ``jobs > 1`` (round-robin, open loop only) replicas split over ``jobs`` processes."""
    from nightjar.offline.simulate import SimConfig

    cfg = cfg or SimConfig()
    jobs = max(1, min(jobs, replicas))
    if jobs == 1:
        return ClusterSimulation(profile, workload, policy, replicas, router, cfg, acceptance).run()
    if not parallel_ok(router, cfg):
        raise ValueError("--jobs > 1 needs --router round-robin without --closed-loop (other routers and "
                         "closed loops couple the replicas)")
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.perf_counter()
    args = (profile, workload, policy, replicas, router, cfg, acceptance)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as ex:
        futures = [ex.submit(_run_part, args, list(range(j, replicas, jobs))) for j in range(jobs)]
        parts = [p for f in futures for p in f.result()]
    return merge(router, policy, workload, cfg, parts, time.perf_counter() - t0)


def format_cluster(results: list[ClusterResult], per_replica: bool = True) -> str:
    head = (f"{'router':<14} {'policy':<12} {'repl':>4} {'reqs':>7} {'done':>7} {'out tok/s':>10} {'TTFT s':>8} "
            f"{'p99 TTFT':>8} {'E2E s':>8} {'wall s':>7}")
    lines = [head, "-" * len(head)]
    for c in results:
        lines.append(f"{c.router:<14} {c.policy:<12} {len(c.replicas):>4} {c.num_requests:>7} {c.finished:>7} "
                     f"{c.throughput:>10.1f} {c.mean_ttft_s:>8.3f} {c.p99_ttft_s:>8.3f} {c.mean_e2e_s:>8.3f} "
                     f"{c.wall_s:>7.2f}")
        if per_replica:
            for i, r in enumerate(c.replicas):
                acc = "-" if r.acceptance is None else f"{r.acceptance:.2f}"
                lines.append(f"{'':<14} {'  replica ' + str(i):<12} {'':>4} {r.num_requests:>7} {r.finished:>7} "
                             f"{r.out_tokens / c.sim_time_s:>10.1f} {r.mean_ttft_s:>8.3f} {'':>8} "
                             f"{r.mean_e2e_s:>8.3f}   γ {r.mean_gamma:.2f} B {r.mean_batch:.1f} acc {acc} "
                             f"off/re {r.offloads}/{r.reloads}")
    return "\n".join(lines)


# ---- command line: `nightjar simulate --replicas N --router POLICY` --------------------------------------
def add_cluster_args(p) -> None:
    g = p.add_argument_group("replicas (a simulated cluster behind one router)")
    g.add_argument("--replicas", type=int, default=None, metavar="N",
                   help="simulate N replicas of the engine, each with its own actors and executor")
    g.add_argument("--router", default="round-robin", choices=ROUTERS,
                   help="how the router picks a replica (default round-robin)")
    g.add_argument("--per-replica", action="store_true", help="print one line per replica as well")
    g.add_argument("--jobs", type=int, default=None, metavar="J",
                   help="processes (round-robin, open loop: the replicas are independent, results are the "
                        "serial run's); default: every CPU for round-robin, else 1")


def main(argv: list[str] | None = None) -> int:
    """``nightjar simulate``: the plain simulation, or with ``--replicas`` a simulated cluster."""
    import json
    import os
    import sys

    from nightjar.offline import simulate as single
    from nightjar.offline.sim.workload import make_workload

    p = single.build_parser()
    add_cluster_args(p)
    a = p.parse_args(argv)
    if a.replicas is None:
        given = argv if argv is not None else sys.argv[1:]
        if any(x.startswith("--router") or x == "--per-replica" for x in given):
            raise ValueError("--router and --per-replica need --replicas N")
        return single.main(argv)
    if a.replicas < 1:
        raise ValueError(f"--replicas must be >= 1 (got {a.replicas})")
    if a.trace_out:
        raise ValueError("--trace-out records one engine's bus: not supported with --replicas")
    profile = single.load_profile(a)
    wl = make_workload(a.workload, seed=a.seed, num_requests=a.num_requests, duration_s=a.duration,
                       phase_s=a.phase_s, prompt_mean=a.prompt_len, output_mean=a.output_len, sigma=a.len_sigma,
                       max_len=a.max_model_len)
    acc = single.acceptance_model(a)
    cfg = single.SimConfig(gamma_max=a.gamma_max, max_num_seqs=a.max_num_seqs,
                           max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
                           seed=a.seed, num_blocks=a.num_blocks, closed_loop=a.closed_loop,
                           planner_profile=not a.no_planner_profile)
    print(f"profile {profile.name} x {a.replicas} replicas, router {a.router}; workload {a.workload}: "
          f"{len(wl)} requests", file=sys.stderr)
    jobs = a.jobs if a.jobs is not None else (os.cpu_count() or 1) if parallel_ok(a.router, cfg) else 1
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1 (got {jobs})")
    results = [run_cluster(profile, wl, pol, a.replicas, a.router, cfg, acc, jobs)
               for pol in (x.strip() for x in a.policies.split(",") if x.strip())]
    if a.json:
        print(json.dumps([{**{k: v for k, v in r.__dict__.items() if k != "replicas"}, "throughput": r.throughput,
                           "replicas": [{**x.__dict__, "throughput": x.out_tokens / r.sim_time_s}
                                        for x in r.replicas]} for r in results], indent=1))
    else:
        print(format_cluster(results, per_replica=a.per_replica))
    return 0
