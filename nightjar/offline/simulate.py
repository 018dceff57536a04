"""``nightjar simulate``: what-if simulation on the real control-plane actors.

The SAME admission, batcher, planner (real policies), KV pool and weight mover run on a virtual clock,
driven by a synchronous dispatcher; a simulated executor replaces draft + verifier (step time from a
profile, acceptance from a per-position model) and a simulated transfer worker moves the draft.
Policies are compared on identical arrivals and lengths (same seed).

  nightjar simulate --gpu a100 --model-shape 13b --workload poisson:8 --num-requests 2000 \\
      --policies off,fixed:3,nightjar
  nightjar simulate --profile prof.json --workload spike --policies off,fixed:3,nightjar
  nightjar simulate --profile prof.json --workload phases.json --fit-trace run.njtrace
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

from nightjar.actors.control import ControlSpec, build_control_actors
from nightjar.actors.step_profile import Profile, roofline_profile
from nightjar.kernel.config import EngineConfig
from nightjar.kernel.messages import SamplingSpec, SubmitRequest
from nightjar.offline.sim.dispatch import SyncBus
from nightjar.offline.sim.executors import (
    DEFAULT_ACCEPTANCE,
    AcceptanceMix,
    SimCollector,
    SimExecutor,
    SimTransfer,
    fit_acceptance,
)
from nightjar.offline.sim.workload import Workload, make_workload


@dataclass
class SimConfig:
    gamma_max: int = 4
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    max_queue: int = 1 << 30            # admission's 429 limit: effectively unbounded in simulation
    seed: int = 0
    elastic_memory: bool | None = None
    low_free_frac: float = 0.10
    persist_steps: int = 3
    num_blocks: int | None = None       # override the profile's pool size
    closed_loop: int = 0                # N > 0: N clients, each sends its next request when one finishes
    planner_profile: bool = True        # hand the profile to a model-based planner (as `nightjar profile` would)
    planner_profile_scale: float = 1.0  # ... scaled (a deliberately wrong profile, for robustness checks)


@dataclass
class SimResult:
    policy: str
    num_requests: int
    finished: int
    sim_time_s: float
    wall_s: float
    out_tokens: int
    mean_ttft_s: float
    mean_e2e_s: float
    mean_gamma: float
    mean_batch: float
    acceptance: float | None
    offloads: int
    reloads: int
    steps: int
    extra: dict = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.out_tokens / self.sim_time_s if self.sim_time_s > 0 else 0.0


def sim_spec(profile: Profile, policy: str, cfg: SimConfig) -> ControlSpec:
    """The ControlSpec of a simulated engine (synthetic vocab, no eos)."""
    config = EngineConfig(policy=policy, gamma_max=cfg.gamma_max, block_size=profile.block_size,
                          max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                          max_model_len=cfg.max_model_len, max_queue=cfg.max_queue, seed=cfg.seed,
                          elastic_memory=cfg.elastic_memory, low_free_frac=cfg.low_free_frac,
                          persist_steps=cfg.persist_steps)
    prof = {"profile": profile.to_json(), "scale": cfg.planner_profile_scale} if cfg.planner_profile else None
    return ControlSpec(config=config, num_blocks=cfg.num_blocks or profile.num_blocks, vocab_size=32,
                       max_position=cfg.max_model_len, draft="sim", draft_bytes=profile.draft_bytes,
                       draft_blocks=profile.draft_blocks, planner_profile=prof)


class Simulation:
    def __init__(self, profile: Profile, workload: Workload, policy: str, cfg: SimConfig | None = None,
                 acceptance=DEFAULT_ACCEPTANCE, trace: str | None = None) -> None:
        self.cfg = cfg = cfg or SimConfig()
        self.profile, self.workload, self.policy = profile, workload, policy
        self.bus = SyncBus()
        self.spec = sim_spec(profile, policy, cfg)
        self.actors = actors = build_control_actors(self.spec)
        actors["weights"].transfer = SimTransfer(self.bus, profile)
        self.executor = SimExecutor(profile, acceptance, cfg.max_num_seqs, cfg.gamma_max, cfg.seed)
        self.collector = SimCollector(self._finished if cfg.closed_loop else None, curve=cfg.closed_loop > 0)
        for a in [*actors.values(), self.executor, self.collector]:
            self.bus.add(a)
        self.writer = None
        if trace:
            from nightjar.kernel.trace import TraceWriter
            self.writer = TraceWriter(trace, {**self.spec.header(), "simulated": profile.name}, max_bytes=None)
            self.bus.taps.append(self.writer.write)
        self._prompts: dict[int, tuple[int, ...]] = {}
        self._i = 0

    def _prompt(self, n: int) -> tuple[int, ...]:
        p = self._prompts.get(n)
        if p is None:
            p = self._prompts[n] = (7,) * n
        return p

    def _finished(self, n: int) -> None:
        """Closed loop: each finished request frees its client, which sends the next one now."""
        for _ in range(n):
            if self._i < len(self.workload):
                self._submit()

    def _submit(self) -> None:
        w, i = self.workload, self._i
        sp = SamplingSpec(max_tokens=int(w.output_lens[i]), ignore_eos=True)
        self.bus.publish("client", [SubmitRequest(req_id=i + 1, prompt_ids=self._prompt(int(w.prompt_lens[i])),
                                                  sampling=sp)])
        self._i += 1

    def _arrive(self) -> None:
        w, i = self.workload, self._i
        sp = SamplingSpec(max_tokens=int(w.output_lens[i]), ignore_eos=True)
        self.bus.publish("client", [SubmitRequest(req_id=i + 1, prompt_ids=self._prompt(int(w.prompt_lens[i])),
                                                  sampling=sp)])
        self._i += 1
        if self._i < len(w):
            self.bus.at(float(w.times[self._i]), self._arrive)

    def tokens_by(self, t: float) -> int:
        """Output tokens committed by simulated time ``t`` (closed-loop runs record the curve)."""
        from bisect import bisect_right
        curve = self.collector.curve or []
        i = bisect_right(curve, (t, float("inf")))
        return curve[i - 1][1] if i else 0

    def run(self) -> SimResult:
        t0 = time.perf_counter()
        self.bus.start(self.actors.values())
        if self.cfg.closed_loop:
            self.bus.at(0.0, lambda: [self._submit() for _ in range(min(self.cfg.closed_loop, len(self.workload)))])
        elif len(self.workload):
            self.bus.at(float(self.workload.times[0]), self._arrive)
        self.bus.run()
        wall = time.perf_counter() - t0
        if self.writer is not None:
            self.writer.close()
        return self._result(wall)

    def _result(self, wall: float) -> SimResult:
        c, w = self.collector, self.actors["weights"]
        done = [r for r in c.done if r in c.arrival]
        ttft = [c.first[r] - c.arrival[r] for r in done if r in c.first]
        e2e = [c.done[r] - c.arrival[r] for r in done]
        t_start = 0.0 if self.cfg.closed_loop or not len(self.workload) else float(self.workload.times[0])
        return SimResult(
            policy=self.policy, num_requests=len(self.workload), finished=len(done),
            sim_time_s=max(c.t_last - t_start, 1e-9), wall_s=wall, out_tokens=c.out_tokens,
            mean_ttft_s=sum(ttft) / len(ttft) if ttft else float("nan"),
            mean_e2e_s=sum(e2e) / len(e2e) if e2e else float("nan"),
            mean_gamma=c.gamma_sum / c.steps if c.steps else 0.0, mean_batch=c.batch_sum / c.steps if c.steps else 0.0,
            acceptance=c.accepted / c.drafted if c.drafted else None,
            offloads=getattr(w, "num_offloads", 0), reloads=getattr(w, "num_reloads", 0), steps=c.steps,
            extra={"preemptions": self.actors["batcher"].num_preemptions, "handled": self.bus.num_handled,
                   "busy_s": self.executor.busy_s, "row_gamma": dict(sorted(c.row_gamma.items())),
                   "early_t": c.early_t or None,
                   "early_throughput": c.early_tokens / c.early_t if c.early_t > 0 else None},
        )


def simulate(profile: Profile, workload: Workload, policy: str, cfg: SimConfig | None = None,
             acceptance=DEFAULT_ACCEPTANCE, trace: str | None = None) -> SimResult:
    return Simulation(profile, workload, policy, cfg, acceptance, trace).run()


def format_results(results: list[SimResult]) -> str:
    head = (f"{'policy':<20} {'reqs':>7} {'done':>7} {'out tok/s':>10} {'TTFT s':>8} {'E2E s':>8} {'mean γ':>7} "
            f"{'mean B':>7} {'accept':>7} {'off/re':>7} {'sim s':>8} {'wall s':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        acc = "-" if r.acceptance is None else f"{r.acceptance:.2f}"
        lines.append(f"{r.policy:<20} {r.num_requests:>7} {r.finished:>7} {r.throughput:>10.1f} {r.mean_ttft_s:>8.3f} "
                     f"{r.mean_e2e_s:>8.3f} {r.mean_gamma:>7.2f} {r.mean_batch:>7.1f} {acc:>7} "
                     f"{r.offloads:>3}/{r.reloads:<3} {r.sim_time_s:>8.1f} {r.wall_s:>7.2f}")
    return "\n".join(lines)


def load_profile(a: argparse.Namespace) -> Profile:
    if a.profile:
        return Profile.load(a.profile)
    if not a.gpu:
        raise SystemExit("nightjar simulate: give --profile FILE or --gpu NAME (with --model-shape)")
    return roofline_profile(a.gpu, a.model_shape, block_size=a.block_size, max_b=max(256, a.max_num_seqs))


def acceptance_model(a: argparse.Namespace):
    """The shared per-position rates, or an AcceptanceMix of request classes (``--acceptance-mix``)."""
    if a.acceptance_mix and a.acceptance_mix.startswith("trace:"):
        from nightjar.kernel.messages import StepVerified
        from nightjar.kernel.trace import TraceReader
        path = a.acceptance_mix[len("trace:"):]
        steps = [e.msg for e in TraceReader(path, allow_schema_drift=True) if isinstance(e.msg, StepVerified)]
        return AcceptanceMix.from_trace(steps, a.gamma_max)
    if a.acceptance_mix:
        try:
            return AcceptanceMix.parse(a.acceptance_mix)
        except ValueError as e:
            raise ValueError(f"--acceptance-mix: {e}") from None
    if a.acceptance:
        vals = [float(x) for x in a.acceptance.split(",")]
        return tuple(vals + [vals[-1]] * max(0, a.gamma_max - len(vals)))
    if a.fit_trace:
        from nightjar.kernel.messages import StepTimed
        from nightjar.kernel.trace import TraceReader
        steps = [e.msg for e in TraceReader(a.fit_trace, allow_schema_drift=True) if isinstance(e.msg, StepTimed)]
        return fit_acceptance(steps, a.gamma_max)
    return DEFAULT_ACCEPTANCE[: a.gamma_max]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nightjar simulate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    src = p.add_argument_group("profile")
    src.add_argument("--profile", help="JSON from `nightjar profile`")
    src.add_argument("--gpu", help="roofline profile: a100, a100-80g, h100, l20, rtx4090")
    src.add_argument("--model-shape", default="13b", help="7b, 8b, 13b, 32b (with a 0.5B-1B draft)")
    src.add_argument("--block-size", type=int, default=16)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="poisson:4",
                   help="poisson:RATE, gamma:RATE:BURSTINESS, spike, oscillation, worst, or a phases JSON file")
    w.add_argument("--num-requests", type=int, default=None)
    w.add_argument("--duration", type=float, default=None, help="seconds of poisson/gamma arrivals")
    w.add_argument("--phase-s", type=float, default=30.0, help="phase length of the built-in stress shapes")
    w.add_argument("--prompt-len", type=float, default=128, help="mean prompt tokens (log-normal)")
    w.add_argument("--output-len", type=float, default=128, help="mean output tokens (log-normal)")
    w.add_argument("--len-sigma", type=float, default=0.6, help="log-normal sigma of lengths (0: fixed)")
    w.add_argument("--seed", type=int, default=0)
    e = p.add_argument_group("engine")
    e.add_argument("--policies", default="off,fixed:3,nightjar")
    e.add_argument("--gamma-max", type=int, default=4)
    e.add_argument("--max-num-seqs", type=int, default=64)
    e.add_argument("--max-num-batched-tokens", type=int, default=512)
    e.add_argument("--max-model-len", type=int, default=2048)
    e.add_argument("--num-blocks", type=int, default=None)
    e.add_argument("--closed-loop", type=int, default=0, help="N clients, each sending its next request when one ends")
    e.add_argument("--no-planner-profile", action="store_true",
                   help="do not give the model-based planner the profile (it falls back to its generic prior)")
    e.add_argument("--acceptance", default=None, help="per-position acceptance rates, e.g. 0.8,0.75,0.7")
    e.add_argument("--fit-trace", default=None, help="fit per-position acceptance from a recorded trace")
    e.add_argument("--acceptance-mix", default=None, metavar="W:R[,R..];W:R..",
                   help="per-request acceptance: request classes drawn by weight, e.g. '0.5:0.9;0.5:0.1' "
                        "(synthetic: half accept 0.9 per position, half 0.1), or 'trace:RUN.njtrace' (one "
                        "class per recorded request, its rates fitted from the rows it drafted)")
    p.add_argument("--trace-out", default=None, help="record the (first policy's) simulated bus to this trace")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    profile = load_profile(a)
    wl = make_workload(a.workload, seed=a.seed, num_requests=a.num_requests, duration_s=a.duration,
                       phase_s=a.phase_s, prompt_mean=a.prompt_len, output_mean=a.output_len, sigma=a.len_sigma,
                       max_len=a.max_model_len)
    acc = acceptance_model(a)
    cfg = SimConfig(gamma_max=a.gamma_max, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                    max_model_len=a.max_model_len, seed=a.seed, num_blocks=a.num_blocks, closed_loop=a.closed_loop,
                    planner_profile=not a.no_planner_profile)
    print(f"profile {profile.name}: {cfg.num_blocks or profile.num_blocks} KV blocks of {profile.block_size}, "
          f"draft {profile.draft_blocks} blocks; workload {a.workload}: {len(wl)} requests; "
          f"acceptance {', '.join(f'{x:.2f}' for x in (acc.mean() if isinstance(acc, AcceptanceMix) else acc))}"
          f"{' (mean of the request classes)' if isinstance(acc, AcceptanceMix) else ''}", file=sys.stderr)
    results = []
    for i, pol in enumerate(x.strip() for x in a.policies.split(",") if x.strip()):
        results.append(simulate(profile, wl, pol, cfg, acc, a.trace_out if i == 0 else None))
    if a.json:
        import json
        print(json.dumps([{**r.__dict__, "throughput": r.throughput} for r in results], indent=1))
    else:
        print(format_results(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
