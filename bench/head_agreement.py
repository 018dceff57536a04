"""Teacher-forced agreement of a draft head with the target on held-out prompts, and the fixed:1 acceptance
those per-position hits imply (rounds skip a position after each accepted draft).

    python bench/head_agreement.py [--head nightjar/models/drafts/smollm2-135m-head[,DIR...]] [--prompts 24]
                                   [--max-tokens 64] [--by-category] [--by-confidence] [--corpus answers.jsonl]

The target answers greedily (bf16, dense generator); the head runs the training-time unrolled pass over
prompt + answer (the same computation as paged drafting, tested in tests/training/test_eagle_training.py).
Step j's hit at answer position i: the head's argmax (through d2t) equals the target's argmax.
``--corpus`` scores the greedy answers of an answers corpus's validation split (``split_validation``) instead
of the held-out prompts, each cut to --max-tokens (categories from the ids: ``tpl``/``tpd`` templated);
``--by-confidence`` splits the first position by the target's probability of its own argmax.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from nightjar.data import load_prompts
from nightjar.models import load_model
from nightjar.models.eagle import is_head_dir, load_head
from nightjar.training.answers import generate_answers
from nightjar.training.distill import split_validation
from nightjar.training.eagle import dense_target, is_text, read_corpus, ttt_forward

CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


def hits_of(model, head, prompt: list[int], answer: list[int], steps: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(per unrolled step j: bool [answer positions] of head argmax == target argmax, the target's probability
    of that argmax [answer positions]); the label of entry i is the target's prediction at i+1."""
    seq = torch.tensor([prompt + answer])                                           # [1, S]
    feats, logits = dense_target(model, seq, head.hc.feature_layers)               # [1, S, F], [1, S, V]
    emb = model.embed_tokens(torch.cat([seq[:, 1:], seq[:, -1:]], 1))             # x_{i+1} [1, S, H]
    outs = ttt_forward(head, feats, emb, torch.arange(seq.shape[1])[None], steps)
    conf, tgt = logits[0].float().softmax(-1).max(-1)                              # [S], [S]
    P, S = len(prompt), seq.shape[1]
    return [(head.d2t[head.logits(o[0]).argmax(-1)][P - 1: S - 2] == tgt[P: S - 1]) for o in outs], conf[P: S - 1]


def tally_confidence(hits0: torch.Tensor, conf: torch.Tensor, bins: list[list[int]]) -> None:
    """Add one answer's first-position hits to ``bins`` ([hits, positions] per CONFIDENCE_EDGES interval, the
    last one closed)."""
    idx = torch.bucketize(conf, torch.tensor(CONFIDENCE_EDGES[1:-1]), right=True)  # [positions] bin of each
    for b in range(len(bins)):
        sel = idx == b
        bins[b][0] += int(hits0[sel].sum())
        bins[b][1] += int(sel.sum())


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
    ap.add_argument("--by-confidence", action="store_true",
                    help="first-position agreement by the target's probability of its argmax")
    ap.add_argument("--corpus", default=None, help="score this answers corpus's validation split instead")
    a = ap.parse_args(argv)
    heads = [Path(h) for h in a.head.split(",")]
    for h in heads:
        if not is_head_dir(h):
            ap.error(f"--head {h}: not a draft head directory (head_config.json + head.safetensors)")
    if a.prompts < 0 or a.steps < 1 or a.max_tokens < 1:
        ap.error("--prompts must be >= 0, --steps and --max-tokens >= 1")
    cases = corpus_cases(ap, a) if a.corpus else None
    torch.set_grad_enabled(False)
    t = load_model(a.model, dtype=torch.bfloat16, pack=False)
    cases = cases if cases is not None else heldout_answers(t, a)
    for path in heads:
        head = load_head(path, t.model.cfg, torch.bfloat16)
        groups: dict[str, tuple[list[list[int]], list[int]]] = {}
        bins = [[0, 0] for _ in CONFIDENCE_EDGES[1:]]
        for category, prompt, ans in cases:
            hits, conf = hits_of(t.model, head, prompt, ans, a.steps)
            tally_confidence(hits[0], conf, bins)
            for key in ("all", category) if a.by_category else ("all",):
                per_step, rounds = groups.setdefault(key, ([[0, 0] for _ in range(a.steps)], [0, 0]))
                tally(hits, a.steps, per_step, rounds)
        if len(heads) > 1:
            print(path)
        report(groups, bins if a.by_confidence else None)


def heldout_answers(t, a) -> list[tuple[str, list[int], list[int]]]:
    """(category, prompt ids, the target's greedy answer ids) of the first --prompts held-out prompts."""
    rows = load_prompts(split="heldout")[: a.prompts or None]
    prompts = [t.tokenizer.encode_chat([{"role": "user", "content": r["prompt"]}]) for r in rows]
    answers = generate_answers(t.model, [(p, {"variant": "greedy"}) for p in prompts], batch=len(prompts),
                               max_new=a.max_tokens, log=lambda *_: None)
    return [(r["category"], p, ans if isinstance(ans, list) else ans["answer_ids"])
            for r, p, ans in zip(rows, prompts, answers)]


def corpus_cases(ap, a) -> list[tuple[str, list[int], list[int]]]:
    """``validation_answers`` of --corpus, or a one-line exit 2 when it is no answers corpus."""
    if not Path(a.corpus).is_file():
        ap.error(f"--corpus {a.corpus}: no such file")
    try:
        return validation_answers(Path(a.corpus), a.prompts, a.max_tokens)
    except (ValueError, KeyError, TypeError) as e:      # not JSON lines, or records of another kind
        ap.error(f"--corpus {a.corpus}: not an answers corpus ({type(e).__name__}: {e})")


def validation_answers(corpus: Path, n: int, max_tokens: int) -> list[tuple[str, list[int], list[int]]]:
    """(category, prompt ids, answer ids cut to ``max_tokens``) of the greedy answers of the corpus's validation
    split (the first ``n``, 0: all); the category is the id's prefix (``tpl``, ``tpd``: templated)."""
    records, _ = read_corpus(corpus)
    _, val = split_validation([r for r in records if not is_text(r)])
    val = [r for r in val if r["variant"] == "greedy"][: n or None]
    return [(r["id"].split("-")[0], r["prompt_ids"], r["answer_ids"][:max_tokens]) for r in val]


def report(groups: dict, bins: list[list[int]] | None) -> None:
    for key, (per_step, rounds) in sorted(groups.items(), key=lambda kv: (kv[0] != "all", kv[0])):
        label = "" if key == "all" else f"  {key}: "
        print(f"{label}teacher-forced agreement per unrolled step:",
              [round(h / max(1, n), 3) for h, n in per_step], "positions", [n for _, n in per_step])
        print(f"{label}fixed:1 acceptance implied: {rounds[0] / max(1, rounds[1]):.3f} over {rounds[1]} rounds")
    if bins is None:
        return
    total = max(1, sum(n for _, n in bins))
    for (lo, hi), (h, n) in zip(zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:]), bins):
        print(f"  target's top-1 probability in [{lo:.1f}, {hi:.1f}{']' if hi == 1.0 else ')'}: "
              f"{n / total:.3f} of positions, first-position agreement {h / max(1, n):.3f}")


if __name__ == "__main__":
    main()
