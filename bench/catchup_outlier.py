"""One slow catch-up and the nightjar planner: does a single outlier (a first run that paid a compile, a capture
or an allocation) keep γ = 0 for later requests?

    python bench/catchup_outlier.py [--spikes 0,0.2,1.0] [--at 1] [--rounds 3] [--tokens 128]

Planner only, no engine: B = 1, rounds of one request each (a 128-token prompt the draft must catch up, then
``--tokens`` generated), H200-like step times read off docs/benchmarks.md "GPU: one H200" (γ = 0 6.2 ms; γ = g
5.9 + 2.3·g ms; a catch-up 10 ms + 0.05 ms per token), SYNTHETIC acceptance 0.7 per position. The
``--at``-th catch-up of the run (the first by default) takes ``spike`` seconds more. Prints per round the
steps at each γ and the catch-up line (c0, c1) the planner fitted.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from collections import Counter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from nightjar.actors.policies import PlannerState  # noqa: E402
from nightjar.actors.policy_factory import make_policy  # noqa: E402
from nightjar.kernel.messages import StepTimed  # noqa: E402

T0, T_PASS, T_VERIFY = 0.0062, 0.0023, 0.0059          # seconds: γ = 0 step, one draft pass, verify base
C0, C1, PROMPT, ACCEPT = 0.010, 0.00005, 128, 0.7


class Sim:
    def __init__(self, spike: float, seed: int, at: int = 1) -> None:
        self.p, self.rng, self.spike, self.step = make_policy("nightjar", 4), random.Random(seed), spike, 0
        self.at, self.catchups = at, 0

    def _drafted(self, g: int, lag: int) -> tuple[StepTimed, int]:
        acc, ok = [], True
        for _ in range(g):
            ok = ok and self.rng.random() < ACCEPT
            acc.append(int(ok))
        ct = C0 + C1 * lag if lag >= 2 else 0.0
        self.catchups += ct > 0.0
        if ct and self.catchups == self.at:
            ct += self.spike
        r = StepTimed(step=self.step, batch_size=1, gamma=g, step_time_s=T_VERIFY + T_PASS * g,
                      tokens_emitted=1 + sum(acc), accepted_per_pos=tuple(acc), num_drafts=1, catchup_time_s=ct,
                      catchup_tokens=lag if ct else 0, draft_time_s=T_PASS * g, max_draft_lag=lag)
        return r, 1 + sum(acc)

    def round(self, tokens: int) -> Counter:
        """One request: steps at each γ until ``tokens`` are out."""
        n, prev, lag, prompt_lag, hist = 0, 0, 0, PROMPT, Counter()
        while n < tokens:
            st = PlannerState(draft_resident=True, prev_gamma=prev, lag_tokens=lag, prompt_lag_tokens=prompt_lag,
                              new_prompt_tokens=PROMPT if n == 0 else 0, new_prompts=int(n == 0),
                              max_draft_lag=lag + prompt_lag)
            g = self.p.decide(1, st)
            self.step += 1
            hist[g] += 1
            if g:
                r, out = self._drafted(g, lag + prompt_lag)
                lag = prompt_lag = 0
            else:
                r, out = StepTimed(step=self.step, batch_size=1, gamma=0, step_time_s=T0, tokens_emitted=1), 1
                lag += 1
            self.p.observe(r)
            n, prev = n + out, g
        return hist


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of seconds, got {text!r}") from None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spikes", default="0,0.2,1.0", type=_floats, help="extra seconds of the slow catch-up")
    ap.add_argument("--at", type=int, default=1, help="which catch-up (1 = the first) is slow")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(f"| catch-up {a.at} extra s | " + " | ".join(f"round {i + 1} steps by γ" for i in range(a.rounds))
          + " | fitted (c0, c1) |\n|---|" + "---|" * (a.rounds + 1))
    for spike in a.spikes:
        sim = Sim(spike, a.seed, a.at)
        rounds = [dict(sorted(sim.round(a.tokens).items())) for _ in range(a.rounds)]
        c = sim.p.switch.coef()
        fit = "-" if c is None else f"({c[0] * 1e3:.2f} ms, {c[1] * 1e3:.3f} ms/token)"
        print(f"| {spike:g} | " + " | ".join(str(r) for r in rounds) + f" | {fit} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
