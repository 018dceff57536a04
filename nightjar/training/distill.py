"""Distil a small draft for the default target: ``python -m nightjar.training.distill --out DIR``.

1. The target answers the training prompts (greedy, plus sampled variants) through the engine.
2. Teacher forcing over prompt+answer gives the target's top-k next-token distribution per answer token.
3. The draft (narrow, shallow, tied embeddings initialised from a PCA of the target's) learns those
   soft targets (KL on the renormalised top-k) plus the hard next token. Checkpoints let a stop resume.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from nightjar.data import training_prompts
from nightjar.data.templated import is_templated, templated_prompts
from nightjar.kvpool.cache import KVCache
from nightjar.models import INDEPENDENT_DRAFT_DIR, LlamaModel, build_layout, load_model
from nightjar.models.config import ModelConfig
from nightjar.models.llama import apply_rope
from nightjar.sampling import SamplingParams

TOPK = 16


def draft_config(target: ModelConfig, hidden=256, layers=3, inter=1024, heads=4, kv_heads=2) -> ModelConfig:
    return ModelConfig(vocab_size=target.vocab_size, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads, rms_eps=target.rms_eps,
                       rope_theta=target.rope_theta, max_position=target.max_position, tie_embeddings=True,
                       bos_token_id=target.bos_token_id, eos_token_ids=target.eos_token_ids,
                       name="nightjar/smollm2-135m-draft")


# ---- 1. corpus -----------------------------------------------------------------------------------
def corpus_jobs(templated: int, samples: int, seed: int) -> list[tuple[dict, str]]:
    """(prompt, variant) pairs: a greedy answer to every training prompt (hand-written + templated) and
    ``samples`` sampled answers (variants ``s<seed+i>``) to each hand-written one."""
    hand = training_prompts()
    jobs = [(p, "greedy") for p in hand + templated_prompts(templated, seed)]
    return jobs + [(p, f"s{seed + i}") for i in range(samples) for p in hand]


def _params(variant: str) -> SamplingParams:
    if variant == "greedy":
        return SamplingParams(max_tokens=128)
    return SamplingParams(max_tokens=128, temperature=0.7, top_p=0.95, seed=int(variant[1:]))


async def _answers(engine, jobs):
    async def one(p, variant):
        ids = engine.encode([{"role": "user", "content": p["prompt"]}])
        out = []
        async for o in engine.generate(ids, _params(variant)):
            out += o.token_ids
        return {"id": p["id"], "variant": variant, "prompt_ids": ids, "answer_ids": out}
    return await asyncio.gather(*[one(p, v) for p, v in jobs])


def build_corpus(target, jobs, path: Path, log=print, chunk: int = 512) -> list[dict]:
    """Answers + teacher top-k for every job, appended to ``path`` chunk by chunk: a stopped run resumes
    where it left off (jobs already in the file are skipped)."""
    from nightjar.engine import Engine

    have = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    done = {(r["id"], r["variant"]) for r in have}
    todo = [j for j in jobs if (j[0]["id"], j[1]) not in done]
    log(f"corpus: {len(have)} answers on disk, {len(todo)} to generate")

    async def main():
        async with Engine(policy="off", draft=None, loaded=(target, None), max_num_seqs=128,
                          max_num_batched_tokens=2048, max_queue=100000) as eng:
            for i in range(0, len(todo), chunk):
                t0 = time.time()
                recs = await _answers(eng, todo[i: i + chunk])
                teacher_topk(target, recs)
                with path.open("a") as f:
                    f.write("".join(json.dumps(r) + "\n" for r in recs))
                have.extend(recs)
                log(f"corpus: {len(have)}/{len(done) + len(todo)} answers "
                    f"({sum(len(r['answer_ids']) for r in recs)} tokens in {time.time() - t0:.0f}s)")
    if todo:
        asyncio.run(main())
    return have


# ---- 2. teacher ----------------------------------------------------------------------------------
@torch.inference_mode()
def teacher_topk(target, corpus: list[dict], k: int = TOPK, batch_tokens: int = 2048) -> None:
    """Adds ``topk_ids``/``topk_logp`` per answer position (predicting answer token j from its prefix)."""
    cfg, bs = target.config, 16
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, bs, batch_tokens // bs + 64,
                    target.model.dtype)
    i = 0
    while i < len(corpus):
        group, used = [], 0
        while i < len(corpus) and (not group or used + _len(corpus[i]) <= batch_tokens):
            group.append(corpus[i])
            used += _len(corpus[i]) + bs
            i += 1
        _teacher_group(target.model, cache, group, k, bs)


def _len(rec) -> int:
    return len(rec["prompt_ids"]) + len(rec["answer_ids"])


def _teacher_group(model, cache, group, k, bs):
    chunks, tables, rows, nxt = [], [], [], 0
    for r in group:
        seq = r["prompt_ids"] + r["answer_ids"][:-1] if r["answer_ids"] else r["prompt_ids"]
        nb = -(-len(seq) // bs)
        chunks.append(seq)
        tables.append(tuple(range(nxt, nxt + nb)))
        nxt += nb
        rows.append(len(r["answer_ids"]))
    lay = build_layout(chunks, [0] * len(chunks), tables, bs, rows)
    logp = model(lay, cache).log_softmax(-1)                                      # [N, V]
    top = logp.topk(k, dim=-1)
    pos = 0
    for r, n in zip(group, rows):
        r["topk_ids"] = top.indices[pos: pos + n].tolist()
        r["topk_logp"] = [[round(x, 4) for x in row] for row in top.values[pos: pos + n].tolist()]
        pos += n


# ---- 3. training ---------------------------------------------------------------------------------
def dense_forward(model: LlamaModel, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal forward for training (no paged cache). ids [B, S] -> logits [B, S, V], or [M, V] for
    the positions in ``mask`` only (the LM head over 49k entries dominates the cost)."""
    c = model.cfg
    B, S = ids.shape
    x = model.embed_tokens(ids)                                                   # [B, S, h]
    cos, sin = model.rope(torch.arange(S))                                        # [S, 1, d]
    for layer in model.layers:
        a = layer.self_attn
        hx = layer.input_layernorm(x)
        q, kk, v = a.qkv(hx)
        q = apply_rope(q.view(B, S, c.num_heads, c.head_dim), cos, sin)
        kk = apply_rope(kk.view(B, S, c.num_kv_heads, c.head_dim), cos, sin)
        v = v.reshape(B, S, c.num_kv_heads, c.head_dim)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True)       # [B, nh, S, d]
        x = x + a.o_proj(o.transpose(1, 2).reshape(B, S, c.q_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = model.norm(x)
    return model.lm_head(x if mask is None else x[mask])


def init_draft(cfg: ModelConfig, target: LlamaModel, seed: int) -> LlamaModel:
    """Random layers; embeddings = the target's projected on their top principal directions."""
    torch.manual_seed(seed)
    model = LlamaModel(cfg)
    for name, p in model.named_parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.02)
    emb = target.embed_tokens.weight.detach().float()                            # [V, H]
    _, _, vh = torch.linalg.svd(emb[:8192] - emb[:8192].mean(0), full_matrices=False)
    proj = emb @ vh[: cfg.hidden_size].T                                          # [V, h]
    model.embed_tokens.weight.data.copy_(proj / proj.std() * 0.05)
    model.lm_head.weight = model.embed_tokens.weight
    return model


def make_batches(corpus, max_len: int, batch: int, gen: torch.Generator):
    order = torch.randperm(len(corpus), generator=gen).tolist()
    for i in range(0, len(order) - batch + 1, batch):
        yield [corpus[j] for j in order[i: i + batch]]


def collate(recs, max_len: int, k: int | None = None):
    k = k or next(len(r["topk_ids"][0]) for r in recs if r["topk_ids"])
    seqs = [(r["prompt_ids"] + r["answer_ids"])[-max_len:] for r in recs]
    S = max(len(s) for s in seqs)
    ids = torch.zeros((len(recs), S), dtype=torch.int64)
    tid = torch.zeros((len(recs), S, k), dtype=torch.int64)
    tlp = torch.full((len(recs), S, k), -1e4)
    mask = torch.zeros((len(recs), S), dtype=torch.bool)
    for b, (r, s) in enumerate(zip(recs, seqs)):
        ids[b, : len(s)] = torch.tensor(s)
        n = len(r["answer_ids"])
        start = len(s) - n - 1          # position predicting answer token 0
        lo = max(0, -start)
        if n - lo > 0:
            tid[b, start + lo: start + n] = torch.tensor(r["topk_ids"][lo:n])
            tlp[b, start + lo: start + n] = torch.tensor(r["topk_logp"][lo:n])
            mask[b, start + lo: start + n] = True
    return ids, tid, tlp, mask


def kd_loss(logits, tid, tlp, mask, hard_weight: float = 0.2):
    """KL(teacher top-k renormalised || draft) + hard CE on the teacher's argmax. logits [M, V]."""
    lp = logits.float().log_softmax(-1)                                           # [M, V]
    t = tlp[mask].softmax(-1)                                                     # [M, k]
    ids = tid[mask]
    soft = -(t * lp.gather(-1, ids)).sum(-1).mean()
    hard = -lp.gather(-1, ids[:, :1]).mean()
    return soft + hard_weight * hard


def split_validation(corpus, every: int = 20):
    """Hold out the answers of every ``every``-th prompt id for model selection (not the test split)."""
    ids = sorted({r["id"] for r in corpus})
    val_ids = set(ids[::every])
    return [r for r in corpus if r["id"] not in val_ids], [r for r in corpus if r["id"] in val_ids]


def _forward_batches(model, recs, max_len: int, batch: int):
    """Teacher-forced bf16 forwards over ``recs`` in batches: (records, logits [M, V], tid, tlp, mask)."""
    for i in range(0, len(recs), batch):
        group = recs[i: i + batch]
        ids, tid, tlp, mask = collate(group, max_len)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = dense_forward(model, ids, mask)
        yield group, logits, tid, tlp, mask


@torch.no_grad()
def validation_loss(model, val, max_len: int = 384, batch: int = 16) -> float:
    losses = [kd_loss(logits, tid, tlp, mask).item() for _, logits, tid, tlp, mask in
              _forward_batches(model, val, max_len, batch)]
    return sum(losses) / max(1, len(losses))


@torch.no_grad()
def top1_agreement(model, recs, max_len: int = 384, batch: int = 16) -> dict[str, float]:
    """Teacher-forced share of answer positions where the draft's argmax is the target's, for
    hand-written prompts and templated ones apart (what greedy acceptance at position 1 tracks)."""
    hits = {"hand-written": [0, 0], "templated": [0, 0]}
    for group, logits, tid, _, mask in _forward_batches(model, recs, max_len, batch):
        same = logits.argmax(-1) == tid[mask][:, 0]                                      # [M]
        src = torch.tensor([is_templated(r["id"]) for r in group])[:, None].expand_as(mask)[mask]
        for key, sel in (("hand-written", ~src), ("templated", src)):
            hits[key][0] += int(same[sel].sum())
            hits[key][1] += int(sel.sum())
    return {k: round(h / n, 4) for k, (h, n) in hits.items() if n}


def train(model, corpus, minutes: float, out: Path, lr=2e-3, batch=16, max_len=384, seed=0, log=print,
          freeze_embeddings: bool = True, eval_every: int = 100, max_steps: int | None = None,
          validate: bool = True, embed_lr_mult: float = 1.0):
    """AdamW with warm-up and cosine decay over a time budget; keeps the weights with the best loss on a
    validation split of the training prompts. The embeddings (a PCA of the target's, tied to the LM head)
    stay frozen by default here; the command line trains them slowly (see ``_param_groups``)."""
    corpus, val = split_validation(corpus) if validate and len(corpus) >= 40 else (corpus, [])
    model.embed_tokens.weight.requires_grad_(not freeze_embeddings)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(_param_groups(model, embed_lr_mult), lr=lr, betas=(0.9, 0.98))
    ckpt = out / "checkpoint.pt"
    state = {"step": 0, "epoch": 0, "elapsed": 0.0, "losses": [], "val": [], "best_val": float("inf")}
    best = None
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"resumed at step {state['step']}")
    gen = torch.Generator().manual_seed(seed)
    t_start, last_ck = time.time() - state["elapsed"], time.time()

    def finished() -> bool:
        return time.time() - t_start >= minutes * 60 or bool(max_steps and state["step"] >= max_steps)
    while not finished():
        for recs in make_batches(corpus, max_len, batch, gen):
            ids, tid, tlp, mask = collate(recs, max_len)
            frac = min(1.0, (time.time() - t_start) / (minutes * 60))
            for g in opt.param_groups:
                cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))
                g["lr"] = g["lr_mult"] * lr * min(1.0, (state["step"] + 1) / 50) * cosine
            with torch.autocast("cpu", dtype=torch.bfloat16):      # AMX matmuls; loss in fp32
                logits = dense_forward(model, ids, mask)
            loss = kd_loss(logits, tid, tlp, mask)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            state["step"] += 1
            if val and state["step"] % eval_every == 0:
                best = _select(model, val, state, best, log)
            state["losses"].append(round(loss.item(), 4))
            if state["step"] % 20 == 0:
                log(f"step {state['step']} epoch {state['epoch']} loss {sum(state['losses'][-20:]) / 20:.4f} "
                    f"t {time.time() - t_start:.0f}s")
            if time.time() - last_ck > 300:
                state["elapsed"] = time.time() - t_start
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)
                last_ck = time.time()
            if finished():
                break
        state["epoch"] += 1
    if val:
        best = _select(model, val, state, best, log)
        model.load_state_dict(best)
        state["val_top1"] = top1_agreement(model, val)
        log(f"teacher-forced top-1 agreement on the validation split: {state['val_top1']}")
    state["elapsed"] = time.time() - t_start
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)
    return state


def _param_groups(model: LlamaModel, embed_lr_mult: float) -> list[dict]:
    """Matrices decay; norms do not; the tied embeddings neither decay (rows of tokens the corpus never
    shows would shrink towards zero) nor move at full speed (they start from the target's PCA)."""
    emb = model.embed_tokens.weight
    groups = [{"params": [p for p in model.parameters() if p.requires_grad and p.dim() > 1 and p is not emb],
               "weight_decay": 0.01, "lr_mult": 1.0},
              {"params": [p for p in model.parameters() if p.requires_grad and p.dim() == 1],
               "weight_decay": 0.0, "lr_mult": 1.0}]
    if emb.requires_grad:
        groups.append({"params": [emb], "weight_decay": 0.0, "lr_mult": embed_lr_mult})
    return [g for g in groups if g["params"]]


def _select(model, val, state, best, log):
    v = validation_loss(model, val)
    state["val"].append((state["step"], round(v, 4)))
    if v < state["best_val"]:
        state["best_val"], state["best_step"] = v, state["step"]
        best = {k: t.detach().clone() for k, t in model.state_dict().items()}
    log(f"validation loss {v:.4f} at step {state['step']} (best {state['best_val']:.4f})")
    return best


def save_draft(model: LlamaModel, directory: Path, card: str) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg.to_hf_dict()
    cfg["torch_dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v.detach().to(torch.bfloat16).contiguous()
             for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "README.md").write_text(card)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".distill", help="work dir (corpus, checkpoints)")
    ap.add_argument("--ship", default=str(INDEPENDENT_DRAFT_DIR), help="where the finished draft is saved")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--minutes", type=float, default=75.0, help="training time budget (the shipped draft: 75)")
    ap.add_argument("--samples", type=int, default=3,
                    help="sampled answers per hand-written prompt besides the greedy one")
    ap.add_argument("--templated", type=int, default=2500,
                    help="templated training prompts (nightjar/data/templated.py) answered greedily")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many steps")
    ap.add_argument("--freeze-embeddings", dest="freeze", action="store_true",
                    help="keep the PCA-initialised embeddings fixed (default: train them at --embed-lr-mult)")
    ap.add_argument("--no-validation", dest="validate", action="store_false",
                    help="train on every training prompt (no validation split, keep the last weights)")
    ap.add_argument("--embed-lr-mult", type=float, default=0.3,
                    help="learning-rate multiplier of the embeddings when they are trained")
    ap.add_argument("--corpus-only", action="store_true", help="build (or finish) the corpus, then stop")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(f"[distill {time.strftime('%H:%M:%S')}] {s}", flush=True)  # noqa: E731
    target = load_model(a.model, "bfloat16")
    corpus = build_corpus(target, corpus_jobs(a.templated, a.samples, a.seed), out / "corpus.jsonl", log)
    if a.corpus_only:
        return
    cfg = draft_config(target.config)
    model = init_draft(cfg, target.model, a.seed)
    state = train(model, corpus, a.minutes, out, seed=a.seed, log=log, freeze_embeddings=a.freeze,
                  max_steps=a.max_steps, validate=a.validate, embed_lr_mult=a.embed_lr_mult)
    card = model_card(cfg, corpus, state, a)
    save_draft(model, Path(a.ship), card)
    log(f"saved draft to {a.ship} after {state['step']} steps, final loss {sum(state['losses'][-50:]) / 50:.4f}")


def model_card(cfg: ModelConfig, corpus, state, a) -> str:
    n_tok = sum(len(r["answer_ids"]) for r in corpus)
    return f"""# smollm2-135m-draft

A draft model for speculative decoding with SmolLM2-135M-Instruct, distilled by Nightjar on CPU.

- Shape: Llama, hidden {cfg.hidden_size}, {cfg.num_layers} layers, {cfg.num_heads} heads ({cfg.num_kv_heads} KV),
  MLP {cfg.intermediate_size}, tied embeddings, vocabulary {cfg.vocab_size} (the target's tokenizer).
- Data: the target's own answers (up to 128 tokens) to {len({r['id'] for r in corpus})} training prompts: greedy answers
  to the {_count(corpus, 'greedy', hand=True)} hand-written training prompts (`nightjar/data/prompts.jsonl` train split
  + `prompts_extra.jsonl`) and to
  {_count(corpus, 'greedy', hand=False)} templated ones (`nightjar/data/templated.py`), plus {a.samples} sampled
  answer(s)
  (T 0.7, top-p 0.95) per hand-written prompt: {len(corpus)} answers, {n_tok} answer tokens. The held-out
  split was never seen.
- Objective: KL to the target's renormalised top-{TOPK} next-token distribution + 0.2 × CE on its argmax.
  Embeddings initialised from a PCA of the target's embedding matrix.
- Training: {state['step']} steps of AdamW (batch 16, lr 2e-3 with a cosine over {a.minutes:g} min, weight decay
  0.01, embeddings {'frozen' if a.freeze else f'trained at {a.embed_lr_mult:g}× lr without decay'}),
  {state['elapsed'] / 60:.1f} min on 2 CPU cores; final training
  loss {sum(state['losses'][-50:]) / max(1, len(state['losses'][-50:])):.3f}; {_selection(state, a)}.
{_agreement(state)}- Reproduce: `python -m nightjar.training.distill {_flags(a)}` (the learning-rate schedule follows
  wall time, so another machine lands near, not on, these weights).

## Measured acceptance
See the section appended by `bench/acceptance.py --write-card`.
"""


def _count(corpus, variant: str, hand: bool) -> int:
    return sum(1 for r in corpus if r["variant"] == variant and is_templated(r["id"]) != hand)


def _selection(state, a) -> str:
    if not a.validate:
        return "shipped the last weights (no validation split)"
    best = state.get("best_val", float("nan"))
    return (f"shipped the weights of step {state.get('best_step')} (best loss {best:.3f} "
            "on a validation split of 1/20 of the training prompts)")


def _agreement(state) -> str:
    if not state.get("val_top1"):
        return ""
    parts = ", ".join(f"{v:.2f} on {k} prompts" for k, v in state["val_top1"].items())
    return f"- Teacher-forced top-1 agreement with the target on the validation answers: {parts}.\n"


def _flags(a) -> str:
    flags = [f"--minutes {a.minutes:g}", f"--samples {a.samples}", f"--templated {a.templated}", f"--seed {a.seed}"]
    flags += ["--freeze-embeddings"] if a.freeze else [f"--embed-lr-mult {a.embed_lr_mult:g}"]
    flags += ["--no-validation"] if not a.validate else []
    flags += [f"--max-steps {a.max_steps}"] if a.max_steps else []
    return " ".join(flags)


if __name__ == "__main__":
    main()
