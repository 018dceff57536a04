"""The policy factory: a name (``off``, ``fixed:3``, ``table:mlc``, ``nightjar``, ...) to a Policy.

Apart from the policies it builds, so that the model-based planner (``policy_model.py``) can build on the
bases in ``policies.py`` without an import cycle."""
from __future__ import annotations

from typing import Any

from nightjar.actors.policies import (
    NIGHTJAR_PAPER_OPTS,
    BanditSpecPolicy,
    DSDPolicy,
    FixedPolicy,
    NightjarPaperPolicy,
    OffPolicy,
    Policy,
    TablePolicy,
    check_opts,
)
from nightjar.actors.policy_model import MODEL_OPTS, ModelNightjarPolicy

_CANONICAL = ("off", "fixed", "table", "dsd", "banditspec", "nightjar", "nightjar-nooffload", "nightjar-paper")
_ALIASES = {"goodput": "dsd", "smartspec": "dsd", "ucb": "banditspec"}


def list_policies() -> tuple[str, ...]:
    """Canonical policy names accepted by :func:`make_policy`."""
    return _CANONICAL


def _make_fixed(arg: str, gamma_max: int) -> FixedPolicy:
    """``fixed:K``."""
    try:
        k = int(arg)
    except ValueError:
        raise ValueError(f"fixed needs an integer K, e.g. 'fixed:3', got 'fixed:{arg}'") from None
    return FixedPolicy(gamma_max, k)


def _make_nightjar(name: str, gamma_max: int, seed: int, opts: dict, suffix: str = "") -> Policy:
    """``nightjar`` / ``nightjar-nooffload`` (model-based; ``:per-request`` gives each row its own γ_i,
    ``:harmonic`` prices one γ by the rows' own acceptance) or ``nightjar-paper`` (bin-greedy)."""
    if name == "nightjar-paper":
        check_opts(name, opts, NIGHTJAR_PAPER_OPTS)
        return NightjarPaperPolicy(gamma_max, seed, **opts)
    check_opts(name, opts, MODEL_OPTS)
    if suffix:
        opts = {**opts, ("harmonic" if suffix == "harmonic" else "per_request"): True}
    p = ModelNightjarPolicy(gamma_max, seed, **opts)
    if name == "nightjar-nooffload":
        p.name, p.elastic_memory = name, False
    if suffix:
        p.name = f"{p.name}:{suffix}"
    return p


def make_policy(spec: str, gamma_max: int = 4, seed: int = 0, **opts: Any) -> Policy:
    """Build a policy from ``spec`` ('off', 'fixed:3', 'table:mlc', 'nightjar', ...)."""
    head, sep, arg = spec.strip().partition(":")
    head = _ALIASES.get(head.strip().lower(), head.strip().lower())
    suffix = arg.strip().lower()
    if head in ("nightjar", "nightjar-nooffload") and sep and suffix not in ("per-request", "harmonic"):
        raise ValueError(f"policy {head!r} takes only ':per-request' or ':harmonic' (got {spec!r})")
    if head not in ("fixed", "table", "nightjar", "nightjar-nooffload") and sep:
        raise ValueError(f"policy {head!r} takes no ':' argument (got {spec!r})")
    if head == "off":
        check_opts(head, opts, ())
        return OffPolicy(gamma_max)
    if head == "fixed":
        check_opts(head, opts, ())
        return _make_fixed(arg.strip(), gamma_max) if sep else _make_fixed("", gamma_max)
    if head == "table":
        check_opts(head, opts, ("max_num_sequence",))
        if not arg.strip():
            raise ValueError("table needs ranges or a preset, e.g. 'table:1-4:4,5-:0' or 'table:mlc'")
        return TablePolicy(gamma_max, arg, **opts)
    if head == "dsd":
        check_opts(head, opts, ("alpha0", "alpha_window", "fit_discount", "probe_every"))
        return DSDPolicy(gamma_max, **opts)
    if head == "banditspec":
        check_opts(head, opts, ("delta", "L", "warmup_rounds", "min_gamma", "reward_scale"))
        return BanditSpecPolicy(gamma_max, **opts)
    if head in ("nightjar", "nightjar-nooffload", "nightjar-paper"):
        return _make_nightjar(head, gamma_max, seed, opts, suffix if sep else "")
    raise ValueError(f"unknown policy {spec!r}; choose from {', '.join(_CANONICAL)}")
