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
                 cfg=None, acceptance=DEFAULT_ACCEPTANCE) -> None:
        from nightjar.offline.simulate import SimConfig, Simulation

        if replicas < 1:
            raise ValueError(f"--replicas must be >= 1 (got {replicas})")
        self.cfg = cfg = cfg or SimConfig()
        self.workload, self.policy = workload, policy
        self.shared = SharedTimers()
        self.router = Router(router, replicas, cfg.seed)
        self.sims = []
        for r in range(replicas):
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
        bus = self.sims[self.router.pick()].bus
        bus.publish("client", [SubmitRequest(req_id=i + 1, prompt_ids=prompt, sampling=sp)])
        self._pending.append(bus)
        self._i += 1

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
        buses = [s.bus for s in self.sims]
        for sim in self.sims:
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
        return self._result(time.perf_counter() - t0)

    def _result(self, wall: float) -> ClusterResult:
        per = []
        ttft, e2e, out_tokens, t_last = [], [], 0, 0.0
        for r, sim in enumerate(self.sims):
            res = sim._result(wall)
            res.num_requests = self.router.sent[r]
            per.append(res)
            c = sim.collector
            done = [q for q in c.done if q in c.arrival]
            ttft += [c.first[q] - c.arrival[q] for q in done if q in c.first]
            e2e += [c.done[q] - c.arrival[q] for q in done]
            out_tokens += c.out_tokens
            t_last = max(t_last, c.t_last)
        t_start = 0.0 if self.cfg.closed_loop or not len(self.workload) else float(self.workload.times[0])
        ttft.sort()
        return ClusterResult(
            router=self.router.policy, policy=self.policy, replicas=per, num_requests=len(self.workload),
            finished=len(e2e), sim_time_s=max(t_last - t_start, 1e-9), wall_s=wall, out_tokens=out_tokens,
            mean_ttft_s=sum(ttft) / len(ttft) if ttft else float("nan"),
            mean_e2e_s=sum(e2e) / len(e2e) if e2e else float("nan"),
            p99_ttft_s=ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else float("nan"))


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


def main(argv: list[str] | None = None) -> int:
    """``nightjar simulate``: the plain simulation, or with ``--replicas`` a simulated cluster."""
    import json
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
    results = [ClusterSimulation(profile, wl, pol, a.replicas, a.router, cfg, acc).run()
               for pol in (x.strip() for x in a.policies.split(",") if x.strip())]
    if a.json:
        print(json.dumps([{**{k: v for k, v in r.__dict__.items() if k != "replicas"}, "throughput": r.throughput,
                           "replicas": [{**x.__dict__, "throughput": x.out_tokens / r.sim_time_s}
                                        for x in r.replicas]} for r in results], indent=1))
    else:
        print(format_cluster(results, per_replica=a.per_replica))
    return 0
