"""A planner-only environment for regret measurements: a known cost model and acceptance vector.

Each decode step costs ``target_time(B, γ+1)·target_scale + γ·draft_time(B)·draft_scale`` from a
profile (measured or roofline) times log-normal-ish noise; each drafting row accepts position i with
the conditional rate ``acceptance[i]`` (synthetic acceptance, labelled as such). The per-step oracle
knows both and plays argmin_γ T(B, γ) / (B·E(γ)); regret is measured in expected seconds per token,
so it is not blurred by the sampling noise of the run itself.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from nightjar.actors.policies import PlannerState, Policy
from nightjar.kernel.messages import StepTimed

WEAK = (0.38, 0.39, 0.49, 0.53)       # the shipped CPU draft's conditional rates (docs/benchmarks.md)
GOOD = (0.80, 0.76, 0.72, 0.70)
ACCEPTANCE_VECTORS = [WEAK, (0.5,) * 4, (0.6,) * 4, (0.7, 0.7, 0.65, 0.6), GOOD]   # weak to good drafts


def batch_schedule(seed: int, steps: int) -> list[int]:
    """B changes every 50 steps across 1..64 (±1 jitter inside a phase)."""
    rng, out, b = random.Random(seed), [], 1
    for t in range(steps):
        if t % 50 == 0:
            b = rng.choice([1, 2, 3, 5, 8, 12, 16, 24, 32, 48, 64])
        out.append(max(1, min(64, b + rng.randint(-1, 1))))
    return out


def expected_tokens_pos(acc: tuple[float, ...], g: int) -> float:
    """E(γ) = 1 + Σ_{i≤γ} Π_{k≤i} ρ_k."""
    e = p = 1.0
    for i in range(g):
        p *= acc[i] if i < len(acc) else acc[-1]
        e += p
    return e


@dataclass
class PlannerEnv:
    profile: object
    acceptance: tuple[float, ...]
    noise: float = 0.05
    target_scale: float = 1.0
    draft_scale: float = 1.0

    def mean_time(self, b: int, g: int) -> float:
        p = self.profile
        return p.target_time(b, g + 1) * self.target_scale + g * p.draft_time(b) * self.draft_scale

    def loss(self, b: int, g: int) -> float:
        """Expected seconds per token."""
        return self.mean_time(b, g) / (b * expected_tokens_pos(self.acceptance, g))

    def best(self, b: int, gamma_max: int) -> tuple[int, float]:
        losses = [self.loss(b, g) for g in range(gamma_max + 1)]
        g = min(range(gamma_max + 1), key=losses.__getitem__)
        return g, losses[g]

    def step(self, b: int, g: int, rng: random.Random) -> StepTimed:
        per_pos = [0] * g
        acc = self.acceptance
        for _ in range(b):
            for i in range(g):
                if rng.random() >= acc[min(i, len(acc) - 1)]:
                    break
                per_pos[i] += 1
        f = max(0.3, 1.0 + self.noise * rng.gauss(0.0, 1.0))
        draft = g * self.profile.draft_time(b) * self.draft_scale * f
        return StepTimed(step=0, batch_size=b, gamma=g, step_time_s=self.mean_time(b, g) * f,
                         tokens_emitted=b + sum(per_pos), accepted_per_pos=tuple(per_pos), num_drafts=b if g else 0,
                         draft_time_s=draft)


@dataclass
class RegretRun:
    batch: list[int]
    gamma: list[int]
    loss: list[float]          # expected s/token of the played arm
    best: list[float]          # the oracle's

    def regret(self, start: int = 0, end: int | None = None) -> float:
        """Excess expected cost over the oracle's, as a fraction of the oracle's, on steps [start, end)."""
        lo, hi = self.loss[start:end], self.best[start:end]
        return (sum(lo) - sum(hi)) / sum(hi)


def run_planner(policy: Policy, env_at: Callable[[int], PlannerEnv], batch_at: Callable[[int], int],
                steps: int, seed: int = 0) -> RegretRun:
    """Drive ``policy`` for ``steps`` decode steps against the environment (draft always resident,
    no catch-up: the regret of the γ choice alone)."""
    rng, prev = random.Random(seed), 0
    out = RegretRun([], [], [], [])
    gmax = policy.gamma_max
    for t in range(steps):
        b, env = batch_at(t), env_at(t)
        g = policy.decide(b, PlannerState(True, 0, prev, lag_tokens=0))
        policy.observe(env.step(b, g, rng))
        out.batch.append(b)
        out.gamma.append(g)
        out.loss.append(env.loss(b, g))
        out.best.append(env.best(b, gmax)[1])
        prev = g
    return out
