"""Teacher-forced agreement of a draft head with the target on held-out prompts, and the fixed:1 acceptance
those per-position hits imply (rounds skip a position after each accepted draft).

    python bench/head_agreement.py [--head nightjar/models/drafts/smollm2-135m-head[,DIR...]] [--prompts 24]
                                   [--max-tokens 64] [--by-category]

The target answers greedily (bf16, dense generator); the head runs the training-time unrolled pass over
prompt + answer (the same computation as paged drafting, tested in tests/training/test_eagle_training.py).
Step j's hit at answer position i: the head's argmax (through d2t) equals the target's argmax.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from nightjar.data import load_prompts
from nightjar.models import load_model
from nightjar.models.eagle import is_head_dir, load_head
from nightjar.training.answers import generate_answers
from nightjar.training.eagle import dense_target, ttt_forward


def hits_of(model, head, prompt: list[int], answer: list[int], steps: int) -> list[torch.Tensor]:
    """Per unrolled step j: bool [answer positions] of head argmax == target argmax (label of entry i is the
    target's prediction at i+1)."""
    seq = torch.tensor([prompt + answer])                                           # [1, S]
    feats, logits = dense_target(model, seq, head.hc.feature_layers)               # [1, S, F], [1, S, V]
    emb = model.embed_tokens(torch.cat([seq[:, 1:], seq[:, -1:]], 1))             # x_{i+1} [1, S, H]
    outs = ttt_forward(head, feats, emb, torch.arange(seq.shape[1])[None], steps)
    tgt = logits[0].float().argmax(-1)                                             # [S]
    P, S = len(prompt), seq.shape[1]
    return [(head.d2t[head.logits(o[0]).argmax(-1)][P - 1: S - 2] == tgt[P: S - 1]) for o in outs]


def tally(hits: list[torch.Tensor], steps: int, per_step: list[list[int]], rounds: list[int]) -> None:
    """Add one answer's hits to ``per_step`` ([hits, positions] per unrolled step; step j needs j true entries
    before it) and to ``rounds`` ([accepted, rounds] of fixed:1, where an accepted draft skips a position)."""
    for j, h in enumerate(hits[:steps]):
        per_step[j][0] += int(h[j:].sum())
        per_step[j][1] += max(0, h.numel() - j)
    i, h0 = 0, hits[0].tolist()
    while i < len(h0):
        rounds[0] += int(h0[i])
        rounds[1] += 1
        i += 1 + int(h0[i])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="nightjar/models/drafts/smollm2-135m-head",
                    help="a head directory, or several, comma-separated (each scored on the same answers)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=24, help="first N held-out prompts (0: all 73)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--by-category", action="store_true", help="also a line per prompt category")
    a = ap.parse_args(argv)
    heads = [Path(h) for h in a.head.split(",")]
    for h in heads:
        if not is_head_dir(h):
            ap.error(f"--head {h}: not a draft head directory (head_config.json + head.safetensors)")
    if a.prompts < 0 or a.steps < 1 or a.max_tokens < 1:
        ap.error("--prompts must be >= 0, --steps and --max-tokens >= 1")
    torch.set_grad_enabled(False)
    t = load_model(a.model, dtype=torch.bfloat16, pack=False)
    rows = load_prompts(split="heldout")[: a.prompts or None]
    jobs = [(t.tokenizer.encode_chat([{"role": "user", "content": r["prompt"]}]), {"variant": "greedy"})
            for r in rows]
    answers = generate_answers(t.model, jobs, batch=len(jobs), max_new=a.max_tokens, log=lambda *_: None)
    for path in heads:
        head = load_head(path, t.model.cfg, torch.bfloat16)
        groups: dict[str, tuple[list[list[int]], list[int]]] = {}
        for r, (prompt, _), ans in zip(rows, jobs, answers):
            ans = ans if isinstance(ans, list) else ans["answer_ids"]
            hits = hits_of(t.model, head, prompt, ans, a.steps)
            for key in ("all", r["category"]) if a.by_category else ("all",):
                per_step, rounds = groups.setdefault(key, ([[0, 0] for _ in range(a.steps)], [0, 0]))
                tally(hits, a.steps, per_step, rounds)
        if len(heads) > 1:
            print(path)
        for key, (per_step, rounds) in sorted(groups.items(), key=lambda kv: (kv[0] != "all", kv[0])):
            label = "" if key == "all" else f"  {key}: "
            print(f"{label}teacher-forced agreement per unrolled step:",
                  [round(h / max(1, n), 3) for h, n in per_step], "positions", [n for _, n in per_step])
            print(f"{label}fixed:1 acceptance implied: {rounds[0] / max(1, rounds[1]):.3f} over {rounds[1]} rounds")


if __name__ == "__main__":
    main()
