"""The engine's command-line flags, shared by ``nightjar serve``/``generate`` and the bench harness's
``--server-args``; every default comes from EngineConfig."""
from __future__ import annotations

import argparse

from nightjar.kernel.config import EngineConfig


def add_engine_args(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """The engine's flags; ``serve``: a server's defaults (``--planner-profile`` auto where it is used)."""
    d = EngineConfig()                       # the defaults live in one place: EngineConfig
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=d.model, help="registered name, .gguf file or HF checkpoint dir")
    g.add_argument("--draft", default=d.draft, help='draft: "default" (the shipped draft head for SmolLM2-135M), '
                   '"independent" (the shipped small draft model), a Llama checkpoint or GGUF, a draft head '
                   'directory (head_config.json), "ngram[:MIN-MAX]" (prompt lookup: no weights; n-grams of 1-3 '
                   'tokens by default), or "none"')
    g.add_argument("--policy", default=d.policy,
                   help="speculation policy: nightjar, nightjar-nooffload, nightjar-paper, off, fixed:K, "
                        "table:..., dsd, banditspec; nightjar[-nooffload]:per-request gives each request "
                        "its own draft length per step, nightjar[-nooffload]:harmonic prices one draft length "
                        "by each request's own acceptance (docs/planner.md)")
    g.add_argument("--gamma-max", type=int, default=d.gamma_max, help="largest number of draft tokens per step")
    g.add_argument("--dtype", default=d.dtype, choices=["bfloat16", "float32", "float16"])
    g.add_argument("--quantization", default=d.quantization, choices=["none", "int8", "int4", "w4a8"],
                   help="quantization of the target's layers: weight-only int8 or int4, or w4a8 (int4 weights, "
                   "activations rounded to int8 per group) (CPU only; docs/quantization.md)")
    g.add_argument("--draft-quantization", default=d.draft_quantization,
                   choices=["none", "int8", "int4", "w4a8", "mixed"],
                   help="the draft's quantization (default: as --quantization; beside an unquantized target, "
                   "mixed: int8 copies of its bf16 layers serve calls of up to 3 rows; docs/quantization.md)")
    g.add_argument("--device", default=d.device, help="cpu or cuda")
    g.add_argument("--device-memory", type=float, default=d.device_memory,
                   help="memory budget for weights + KV: bytes (>1) or a fraction of the device (<=1)")
    g.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV pool size in blocks (overrides the budget)")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="context per request; capped by the KV pool with the draft resident (a warning says so)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    g.add_argument("--max-queue", type=int, default=d.max_queue, help="requests in flight before 429s")
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--planner-profile", default=None, metavar="FILE|auto|none",
                   help="step-time profile for the planner: a `nightjar profile` JSON, 'auto' for this model, "
                        "draft, dtype and machine's cached one (measured once, about 30 s, when absent), or 'none' "
                        "for the planner's generic prior, calibrated online; default: "
                        + ("'auto' when the policy is model-based (nightjar, nightjar-nooffload) and a draft is "
                           "loaded, else none" if serve else "none"))
    p.set_defaults(profile_default="auto" if serve else None)
    g.add_argument("--enforce-eager", action="store_true", default=d.enforce_eager,
                   help="CUDA: run every step eagerly (no CUDA graphs for decode/verify steps); CPU is always eager")
    g.add_argument("--inline-compute", action=argparse.BooleanOptionalAction, default=d.inline_compute,
                   help="run loads and forwards on the event loop's thread instead of a compute thread: no thread "
                        "hand-off per step (~0.3 ms each on a small VM), but nothing else runs while a forward does; "
                        "for one client (`generate` turns it on), not for serving")
    g.add_argument("--run-ahead", action=argparse.BooleanOptionalAction, default=d.run_ahead,
                   help="with a compute thread: start the next decode step while the event loop commits this one, "
                        "when both are greedy steps without speculation (no effect with --inline-compute)")
    g.add_argument("--draft-tree", type=int, default=d.draft_tree, metavar="K",
                   help="a draft head's greedy rows also send their K runner-up first drafts, verified beside the "
                        "chain in the same step (0: off; docs/drafts.md)")
    g.add_argument("--prompt-lookup", type=int, default=d.prompt_lookup, metavar="N",
                   help="a draft head's rows whose last N to 3 tokens occurred earlier in the request draft what "
                        "followed them (prompt lookup) instead of the head's chain (0: off; other drafters draft "
                        "as they do; docs/drafts.md)")
    g.add_argument("--draft-tree-batch", type=int, default=d.draft_tree_batch,
                   help="the largest decode batch whose rows send runner-up drafts")
    g.add_argument("--trace", default=d.trace, help="record every bus envelope to this file")


def engine_kwargs(a: argparse.Namespace) -> dict:
    keys = ["model", "draft", "policy", "gamma_max", "dtype", "quantization", "draft_quantization", "device",
            "device_memory", "num_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
            "max_queue", "seed", "planner_profile", "enforce_eager", "inline_compute", "run_ahead", "draft_tree",
            "draft_tree_batch", "prompt_lookup"]
    kw = {k: getattr(a, k) for k in keys}
    kw["draft"] = None if kw["draft"] in ("none", "") else kw["draft"]
    kw["planner_profile"] = _planner_profile(a, kw)
    return kw


def _planner_profile(a: argparse.Namespace, kw: dict) -> str | None:
    """``--planner-profile``: 'none' is the prior; not given, a server's default ('auto') where a profile is read."""
    prof = kw["planner_profile"]
    if prof is None and getattr(a, "profile_default", None) == "auto" and kw["draft"] is not None:
        return "auto" if reads_profile(kw["policy"], kw["gamma_max"]) else None
    return None if prof == "none" else prof


def reads_profile(policy: str, gamma_max: int) -> bool:
    """Does this policy price γ with a step-time profile (the model-based ``nightjar`` family)?"""
    from nightjar.actors.policy_factory import make_policy

    try:
        return hasattr(make_policy(policy, gamma_max), "set_profile")
    except ValueError:                       # a bad policy: check_config names it
        return False
