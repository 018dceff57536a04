"""What a draft head's candidates are worth beyond its top-1 chain: coverage of its top-k, the calibration of its
confidence, and what two drafting schemes would buy, estimated from teacher-forced runs and a step-time profile.

    python bench/head_candidates.py [--head nightjar/models/drafts/smollm2-135m-head] [--prompts 73]
                                    [--max-tokens 96] [--profile FILE|auto] [--batches 1,4,16,64]

The target answers the held-out prompts greedily (bf16); the head runs the training-time unrolled pass over
prompt + answer (the computation paged drafting does while its drafts are accepted, tests/training). For every
answer position and unrolled step j it records the rank of the target's argmax among the head's draft
distribution and the head's top-1 probability. From those:

* coverage: share of positions where the target's argmax is among the head's top k (step 1 = the first draft).
* calibration: agreement at step 1 by the head's top-1 probability.
* confidence stopping (an **estimate**): rows stop drafting once the product of calibrated per-draft
  acceptance falls below a threshold; the best pair of thresholds (keep a draft / run another pass) per batch
  size against the best fixed γ, calibration fitted on even prompts and scored on odd ones; B rows advance
  through answers in lockstep, each step priced as T(B, 1 + Σγ_i/B) + the draft passes.
* width-k first draft (an **estimate**): k candidates for the first draft, each continued by a chain, as a
  token tree would verify them (1 + kγ tokens per row): a round accepts when the target's token is among the
  head's top k, then as far as the chain behind it agrees (the chain behind the matching candidate is the
  teacher-forced one). Priced like the above at B = 1 and 4; past the profile's grid (q = 5) a row of q tokens
  is priced as q/5 rows of 5.
Nothing here runs the engine; these are upper-bound estimates to choose what to build next.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from nightjar.actors.step_profile import Profile
from nightjar.data import load_prompts
from nightjar.models import load_model
from nightjar.models.eagle import is_head_dir, load_head
from nightjar.training.answers import generate_answers
from nightjar.training.eagle import dense_target, ttt_forward

BINS = 10


def ranks_of(model, head, prompt: list[int], answer: list[int], steps: int) -> tuple[np.ndarray, np.ndarray]:
    """[steps, answer positions] rank of the target's argmax in the head's distribution (0 = its top-1; the
    vocabulary size when outside the draft vocabulary) and the head's top-1 probability. Entry t of step j
    drafts answer token t+1 with j drafted entries before it."""
    seq = torch.tensor([prompt + answer])                                           # [1, S]
    feats, logits = dense_target(model, seq, head.hc.feature_layers)               # [1, S, F], [1, S, V]
    emb = model.embed_tokens(torch.cat([seq[:, 1:], seq[:, -1:]], 1))             # x_{i+1} [1, S, H]
    outs = ttt_forward(head, feats, emb, torch.arange(seq.shape[1])[None], steps)
    P, S = len(prompt), seq.shape[1]
    tgt = logits[0, P:S - 1].float().argmax(-1)                                    # [A-1]
    ranks, conf = [], []
    for o in outs:
        q = head.logits(o[0, P - 1:S - 2]).float().softmax(-1)                     # [A-1, Vd]
        full = q.new_zeros(q.shape[0], head.hc.target_vocab)
        full[:, head.d2t] = q
        ranks.append((full > full.gather(1, tgt[:, None])).sum(1).numpy())
        conf.append(q.max(-1).values.numpy())
    return np.stack(ranks), np.stack(conf)


def calibrate(data, idx) -> np.ndarray:
    """[steps, BINS] agreement by top-1 probability bin (Laplace-smoothed), fitted on prompts ``idx``."""
    steps = data[0][0].shape[0]
    hit, n = np.ones((steps, BINS)), np.full((steps, BINS), 2.0)
    for i in idx:
        r, c = data[i]
        b = np.minimum((c * BINS).astype(int), BINS - 1)
        for j in range(steps):
            np.add.at(hit[j], b[j], r[j] == 0)
            np.add.at(n[j], b[j], 1)
    return hit / n


def chain_round(r, c, t0, gmax, keep, go, cal):
    """(accepted, drafts verified, draft passes) of one round from answer entry t0 with thresholds keep / go on
    the product of calibrated acceptance (cal None: a fixed γ = gmax)."""
    g, passes, p = 0, 0, 1.0
    for k in range(gmax):
        t = t0 + k
        if t >= r.shape[1]:
            break
        passes += 1
        if cal is None:
            g = k + 1
            continue
        p *= cal[k, min(int(c[k, t] * BINS), BINS - 1)]
        if p >= keep:
            g = k + 1
        if p < go:
            break
    acc = 0
    while acc < g and r[acc, t0 + acc] == 0:
        acc += 1
    return acc, g, passes


def tree_round(r, t0, width, depth):
    """(accepted, drafts verified, passes): ``width`` first-draft candidates, each followed by depth-1 chain
    drafts (the matching candidate's chain is the teacher-forced one)."""
    if t0 >= r.shape[1]:
        return 0, 0, 0
    acc = 0
    if r[0, t0] < width:
        acc = 1
        while acc < depth and t0 + acc < r.shape[1] and r[acc, t0 + acc] == 0:
            acc += 1
    return acc, width * depth, depth


def verify_time(prof: Profile, B: int, q: float) -> float:
    """T(B, q); past the profile's q grid priced as the same number of tokens in more rows of the largest q
    (T(B·q/q_max, q_max)), since at a few rows a step's cost follows its tokens, not its rows."""
    qmax = prof.q[-1]
    return prof.target_time(B, q) if q <= qmax else prof.target_time(B * q / qmax, qmax)


def lockstep(data, idx, B: int, prof: Profile, round_fn, steps: int = 1500, seed: int = 0) -> float:
    """Tokens/s of B rows that each walk through answers of prompts ``idx``, one round per step."""
    rng = np.random.default_rng(seed)
    rows = [(int(rng.choice(idx)), 0) for _ in range(B)]
    toks = secs = 0.0
    for _ in range(steps):
        res = [round_fn(*data[i], t) for i, t in rows]
        q = 1 + sum(g for _, g, _ in res) / B
        passes = [p for _, _, p in res]
        secs += verify_time(prof, B, q) + sum(prof.draft_time(sum(p > k for p in passes)) for k in range(max(passes)))
        toks += sum(a + 1 for a, _, _ in res)
        rows = [(int(rng.choice(idx)), 0) if t + a + 1 >= data[i][0].shape[1] else (i, t + a + 1)
                for (i, t), (a, _, _) in zip(rows, res)]
    return toks / secs


def stopping_table(data, prof: Profile, batches, gmax: int) -> list[dict]:
    idx = list(range(len(data)))
    fit, score = idx[0::2], idx[1::2]
    cal = calibrate(data, fit)
    out = []
    for B in batches:
        off = lockstep(data, score, B, prof, lambda r, c, t: (0, 0, 0))
        fixed = {g: lockstep(data, score, B, prof, lambda r, c, t, g=g: chain_round(r, c, t, g, 0, 0, None)) / off
                 for g in range(1, gmax + 1)}
        grid = [(k, go) for k in (0, .1, .2, .3, .4, .5) for go in (.1, .2, .3, .4, .5, .7) if go >= k]
        dyn = {kg: lockstep(data, score, B, prof, lambda r, c, t, kg=kg: chain_round(r, c, t, gmax, *kg, cal)) / off
               for kg in grid}
        best = max(dyn, key=dyn.get)
        out.append({"B": B, "fixed_vs_off": {g: round(v, 3) for g, v in fixed.items()},
                    "stopping_best_vs_off": round(dyn[best], 3), "thresholds": best,
                    "stopping_vs_best_static": round(dyn[best] / max(1.0, *fixed.values()), 3)})
    return out


def tree_table(data, prof: Profile, batches, gmax: int) -> list[dict]:
    idx = list(range(len(data)))
    out = []
    for B in batches:
        off = lockstep(data, idx, B, prof, lambda r, c, t: (0, 0, 0))
        for w in (1, 2, 3, 4):
            for d in range(1, gmax + 1):
                rounds = [tree_round(r, t, w, d) for r, _ in data for t in range(r.shape[1])]
                acc = float(np.mean([a for a, _, _ in rounds]))
                speed = lockstep(data, idx, B, prof, lambda r, c, t, w=w, d=d: tree_round(r, t, w, d)) / off
                out.append({"B": B, "width": w, "depth": d, "tokens_per_row": 1 + w * d,
                            "accepted_per_round": round(acc, 3), "vs_off": round(speed, 3)})
    return out


DEFAULT_HEAD = "nightjar/models/drafts/smollm2-135m-head"


def load_profile(spec: str, model: str, head: str) -> Profile:
    """The profile file, or with "auto" this machine's cached one for the pair (bf16), measured if absent."""
    if spec == "auto":
        from nightjar.profile_cache import cached_profile
        spec = cached_profile(model, "default" if head == DEFAULT_HEAD else head, "bfloat16")
    return Profile.load(spec)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--head", default=DEFAULT_HEAD)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=73, help="first N held-out prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--steps", type=int, default=4, help="unrolled steps = the largest γ considered")
    ap.add_argument("--profile", default="auto", help="a `nightjar profile` JSON, or auto: this machine's cached one")
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--json", help="also write the tables here")
    a = ap.parse_args(argv)
    if not is_head_dir(Path(a.head)):
        ap.error(f"--head {a.head}: not a draft head directory (head_config.json + head.safetensors)")
    try:
        batches = [int(b) for b in a.batches.split(",")]
    except ValueError:
        ap.error(f"--batches {a.batches!r}: comma-separated integers")
    if a.profile != "auto" and not Path(a.profile).is_file():
        ap.error(f"--profile {a.profile}: no such file")
    if a.prompts < 2 or a.steps < 1 or a.max_tokens < 2 or min(batches, default=0) < 1:
        ap.error("--prompts >= 2 (calibration and scoring split them), --steps >= 1, --max-tokens >= 2, "
                 "--batches >= 1 each")
    torch.set_grad_enabled(False)
    prof = load_profile(a.profile, a.model, a.head)
    t = load_model(a.model, dtype=torch.bfloat16, pack=False)
    head = load_head(Path(a.head), t.model.cfg, torch.bfloat16)
    jobs = [(t.tokenizer.encode_chat([{"role": "user", "content": r["prompt"]}]), {"variant": "greedy"})
            for r in load_prompts(split="heldout")[: a.prompts]]
    answers = generate_answers(t.model, jobs, batch=min(32, len(jobs)), max_new=a.max_tokens, log=lambda *_: None)
    data = [ranks_of(t.model, head, p, ans if isinstance(ans, list) else ans["answer_ids"], a.steps)
            for (p, _), ans in zip(jobs, answers)]
    report(data, prof, batches, a.steps, a.json)


def report(data, prof: Profile, batches, steps: int, json_path: str | None) -> None:
    cover = [[round(float(np.mean(np.concatenate([r[j, j:] for r, _ in data]) < k)), 3) for k in (1, 2, 3, 4, 8)]
             for j in range(steps)]
    cal = calibrate(data, range(len(data)))
    conf1 = np.concatenate([c[0] for _, c in data])
    hist = np.histogram(conf1, bins=BINS, range=(0, 1))[0]
    print(f"## Top-k coverage of the target's argmax ({sum(r.shape[1] for r, _ in data)} answer positions)\n")
    print("| step | top-1 | top-2 | top-3 | top-4 | top-8 |\n|---|---|---|---|---|---|")
    for j, row in enumerate(cover):
        print(f"| {j + 1} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
    print("\n## Step-1 agreement by the head's top-1 probability\n")
    print("| p bin | positions | agreement |\n|---|---|---|")
    for b in range(BINS):
        print(f"| {b / BINS:.1f}-{(b + 1) / BINS:.1f} | {hist[b]} | {cal[0, b]:.3f} |")
    print(f"\n## Confidence stopping vs fixed γ (estimate; profile {prof.name})\n")
    stop = stopping_table(data, prof, batches, steps)
    print("| B | fixed γ=1..4 / off | stopping / off | thresholds (keep, go on) | stopping / best static |")
    print("|---|---|---|---|---|")
    for s in stop:
        print(f"| {s['B']} | {', '.join(f'{v:.3f}' for v in s['fixed_vs_off'].values())} | "
              f"{s['stopping_best_vs_off']:.3f} | {s['thresholds']} | {s['stopping_vs_best_static']:.3f} |")
    tree = tree_table(data, prof, [b for b in batches if b <= 4], steps)
    print("\n## Width-k first draft (estimate)\n")
    print("| B | width | depth | tokens/row | accepted/round | vs off |\n|---|---|---|---|---|---|")
    for r in tree:
        print(f"| {r['B']} | {r['width']} | {r['depth']} | {r['tokens_per_row']} | {r['accepted_per_round']:.3f} | "
              f"{r['vs_off']:.3f} |")
    if json_path:
        Path(json_path).write_text(json.dumps({"coverage": cover, "calibration": cal[0].round(3).tolist(),
                                               "stopping": stop, "tree": tree}, indent=1))


if __name__ == "__main__":
    main()
