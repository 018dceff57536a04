"""Teacher-forced tokens per γ-round of the draft head, the n-gram drafter and the head with prompt lookup, per
prompt category: what the head executor's ``--prompt-lookup N`` buys before any engine runs.

    python bench/prompt_lookup.py [--head nightjar/models/drafts/smollm2-135m-head] [--prompts 73]
                                  [--max-tokens 96] [--gamma 4]

The target answers the held-out prompts greedily (bf16); rounds of γ drafts then walk each answer as fixed:γ
would: a round at answer position i accepts the drafts that match the answer from i on and moves on by the
accepted drafts + 1. Drafts per round:
- ``head``: the head's unrolled chain (the training-time pass, bench/head_agreement.py: the same computation as
  paged drafting);
- ``ngram:A-B``: actors/draft_ngram.py's NgramIndex over prompt + answer so far (no match: no drafts);
- ``head+lookup:N``: the NgramIndex(N, max(N, 3)) proposal where there is one, else the head's chain, as
  actors/draft_head.py drafts with ``prompt_lookup=N``.
"""
from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch
from head_agreement import hits_of  # bench/head_agreement.py

from nightjar.actors.draft_ngram import NgramIndex
from nightjar.data import load_prompts
from nightjar.models import load_model
from nightjar.models.eagle import is_head_dir, load_head
from nightjar.training.answers import generate_answers


def rounds(answer: list[int], prompt: list[int], hits: list[list[bool]], gamma: int, scheme: str) -> tuple[int, int]:
    """(tokens, rounds) of one answer under ``scheme`` (module docstring)."""
    kind, _, arg = scheme.partition(":")
    lo, _, hi = arg.partition("-")
    idx = (NgramIndex(int(lo), int(hi)) if kind == "ngram" else
           NgramIndex(int(arg), max(int(arg), 3)) if kind == "head+lookup" else None)
    tokens = n_rounds = i = 0
    while i < len(answer):
        prop = idx.propose(prompt + answer[:i], gamma) if idx is not None else []
        k = 0
        if prop:
            while k < len(prop) and i + k < len(answer) and prop[k] == answer[i + k]:
                k += 1
        elif kind != "ngram":                       # the head's chain: step j's hit at position i + j
            while k < gamma and i + k < len(hits[k]) and hits[k][i + k]:
                k += 1
        tokens, n_rounds, i = tokens + k + 1, n_rounds + 1, i + k + 1
    return tokens, n_rounds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default="nightjar/models/drafts/smollm2-135m-head")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=73, help="first N held-out prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--schemes", default="head,ngram:1-3,ngram:2-3,head+lookup:1,head+lookup:2,head+lookup:3")
    a = ap.parse_args(argv)
    if not is_head_dir(Path(a.head)):
        ap.error(f"--head {a.head}: not a draft head directory (head_config.json + head.safetensors)")
    schemes = a.schemes.split(",")
    torch.set_grad_enabled(False)
    t = load_model(a.model, dtype=torch.bfloat16, pack=False)
    head = load_head(Path(a.head), t.model.cfg, torch.bfloat16)
    rows = load_prompts(split="heldout")[: a.prompts]
    jobs = [(t.tokenizer.encode_chat([{"role": "user", "content": r["prompt"]}]), {"variant": "greedy"}) for r in rows]
    answers = generate_answers(t.model, jobs, batch=16, max_new=a.max_tokens, log=lambda *_: None)
    total = {s: [0, 0] for s in schemes}
    by_cat: dict[str, dict[str, list[int]]] = collections.defaultdict(lambda: {s: [0, 0] for s in schemes})
    for (prompt, _), ans, r in zip(jobs, answers, rows):
        ans = ans if isinstance(ans, list) else ans["answer_ids"]
        hits = [h.tolist() for h in hits_of(t.model, head, prompt, ans, a.gamma)]
        for s in schemes:
            tok, n = rounds(ans, prompt, hits, a.gamma, s)
            for acc in (total[s], by_cat[r["category"]][s]):
                acc[0], acc[1] = acc[0] + tok, acc[1] + n
    print(f"tokens per γ = {a.gamma} round (incl. the bonus token), teacher forced, {len(rows)} held-out prompts, "
          f"{a.max_tokens}-token greedy answers\n")
    print("| category | " + " | ".join(schemes) + " |\n|---|" + "---|" * len(schemes))
    for cat, d in sorted(by_cat.items()) + [("all", total)]:
        print(f"| {cat} | " + " | ".join(f"{d[s][0] / d[s][1]:.3f}" for s in schemes) + " |")


if __name__ == "__main__":
    main()
