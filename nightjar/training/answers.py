"""Fast batched answer generation for draft training: ``python -m nightjar.training.answers --out FILE``.

A static-batch generator outside the serving engine: jobs sorted by prompt length, LEFT-padded into
batches, one dense KV cache per layer ``[B, nkv, S_max, d]``, the whole batch prefilled at once and then
decoded one token per step. Rows that finish (an EOS id, kept in the answer as the engine keeps it, or
``max_new`` tokens) are dropped from the batch (cache included) once enough of them have finished.
Writes the records distill.py's corpus uses (without the teacher top-k), resumably, chunk by chunk; with
``--features DIR`` also the target's features and top-k of every record into a head-training feature cache
(training/eagle.py ``CacheWriter``), so that head training does not run the target over the corpus again.
``--passages N`` then answers N more prompts greedily (``data/templated.py`` ``passage_prompts``): summarization
and extraction tasks over paragraphs the target wrote for the templated prompts, and chat-style requests.
"""
from __future__ import annotations

import argparse
import json
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

from nightjar.actors.sampler import SamplingHints, sample_from, transform_logits
from nightjar.data.templated import passage_prompts
from nightjar.models import LlamaModel
from nightjar.models.llama import apply_rope

TEMPERATURE, TOP_P = 0.7, 0.95


def row_generator(prompt_ids: list[int], variant: str) -> torch.Generator | None:
    """Greedy -> None; ``s<seed>`` -> a generator seeded from the seed and the prompt (so two prompts
    under one seed draw different noise, and a job draws the same tokens in any batch)."""
    if variant == "greedy":
        return None
    key = zlib.crc32(json.dumps(prompt_ids).encode())
    return torch.Generator().manual_seed(int(variant[1:]) * 1_000_003 + key)


class _Batch:
    """One static batch: dense per-layer KV, key validity, next positions, per-row bookkeeping."""

    def __init__(self, model: LlamaModel, prompts: list[list[int]], max_new: int):
        c = model.cfg
        B, L = len(prompts), max(len(p) for p in prompts)
        self.L, self.S = L, L + max_new
        ids = torch.zeros((B, L), dtype=torch.int64)
        valid = torch.zeros((B, self.S), dtype=torch.bool)
        for b, p in enumerate(prompts):
            ids[b, L - len(p):] = torch.tensor(p)
            valid[b, L - len(p):] = True                         # prompt + every future decode slot
        self.ids, self.valid = ids, valid                         # [B, L], [B, S]
        self.pos = (valid[:, :L].long().cumsum(-1) - 1).clamp(min=0)   # [B, L]: 0 at the first real token
        shape = (B, c.num_kv_heads, self.S, c.head_dim)
        self.k = [torch.zeros(shape, dtype=model.dtype) for _ in model.layers]   # [B, nkv, S, d] each
        self.v = [torch.zeros(shape, dtype=model.dtype) for _ in model.layers]

    def keep(self, rows: torch.Tensor) -> None:
        """Drop the other rows (their cache too)."""
        self.k = [t[rows] for t in self.k]
        self.v = [t[rows] for t in self.v]
        self.valid, self.pos = self.valid[rows], self.pos[rows]


def _attend(q, k, v, allowed) -> torch.Tensor:
    """Grouped-query attention with each KV head's g query heads folded into the query axis, so one
    SDPA call needs no head expansion (at Q=1 on CPU it measured ~1.5 ms a layer at B=64 where two bf16
    matmuls took 3-11 ms). q [B, nh, Q, d], k/v [B, nkv, K, d], allowed [B, 1, g*Q, K] -> [B, nh, Q, d]."""
    B, nh, Q, d = q.shape
    nkv = k.shape[1]
    qg = q.reshape(B, nkv, nh // nkv * Q, d)                                      # [B, nkv, g*Q, d]
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=allowed).view(B, nh, Q, d)


def _forward(model: LlamaModel, st: _Batch, ids, pos, start: int, allowed, layers: tuple[int, ...] = ()):
    """Run tokens ids [B, Q] at positions pos [B, Q], writing cache slots start..start+Q; attention over
    slots [0, start+Q) where ``allowed`` [B, 1, Q, start+Q]. Returns the last token's logits [B, V] (fp32)
    and, with ``layers``, the raw residual stream after them [B, Q, nF*H] (else None)."""
    c = model.cfg
    B, Q = ids.shape
    end = start + Q
    x = model.embed_tokens(ids)                                                   # [B, Q, h]
    cos, sin = model.rope(pos.reshape(-1))                                        # [B*Q, 1, d]
    cos, sin = cos.view(B, Q, 1, -1), sin.view(B, Q, 1, -1)                       # [B, Q, 1, d]
    allowed = allowed.expand(B, 1, Q, end).repeat(1, 1, c.num_heads // c.num_kv_heads, 1)     # [B, 1, g*Q, end]
    kept = []
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        q, k, v = a.qkv(layer.input_layernorm(x))
        q = apply_rope(q.reshape(B, Q, c.num_heads, c.head_dim), cos, sin)       # [B, Q, nh, d]
        k = apply_rope(k.reshape(B, Q, c.num_kv_heads, c.head_dim), cos, sin)    # [B, Q, nkv, d]
        st.k[i][:, :, start:end] = k.transpose(1, 2)
        st.v[i][:, :, start:end] = v.reshape(B, Q, c.num_kv_heads, c.head_dim).transpose(1, 2)
        o = _attend(q.transpose(1, 2), st.k[i][:, :, :end], st.v[i][:, :, :end], allowed)   # [B, nh, Q, d]
        x = x + a.o_proj(o.transpose(1, 2).reshape(B, Q, c.q_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in layers:
            kept.append(x)
    feats = torch.cat(kept, dim=-1) if kept else None                             # [B, Q, nF*H]
    return model.lm_head(model.norm(x[:, -1])).float(), feats                    # [B, V]


def _pick(logits: torch.Tensor, gens: list[torch.Generator | None]) -> torch.Tensor:
    """Greedy rows take the argmax; sampled rows draw from T 0.7 / top-p 0.95 with their own generator.
    logits [B, V] -> [B] int64."""
    out = logits.argmax(-1)                                                       # [B]
    rows = [b for b, g in enumerate(gens) if g is not None]
    if rows:
        out[rows] = _sample(logits[rows], [gens[b] for b in rows])
    return out


def _sample(logits: torch.Tensor, gens: list[torch.Generator], candidates: int = 256) -> torch.Tensor:
    """Top-p sampling at temperature T: the smallest prefix of the descending probabilities holding
    TOP_P of the mass, renormalised; one uniform per row from its generator. The prefix is looked for
    among the ``candidates`` largest logits (exact when it ends inside them, the usual case at T 0.7;
    other rows take the full-vocabulary path). logits [n, V] -> [n] int64."""
    x = logits.float() / TEMPERATURE                                              # [n, V]
    top_x, top_i = x.topk(min(candidates, x.shape[-1]), dim=-1)                   # [n, C], descending
    p = (top_x - x.logsumexp(-1, keepdim=True)).exp()                             # [n, C] full-vocab probs
    cum = p.cumsum(-1)                                                            # [n, C]
    q = p.masked_fill(cum - p > TOP_P, 0.0)                                       # [n, C] the kept prefix
    out = top_i.gather(-1, sample_from(q, gens)[:, None]).squeeze(-1)             # [n]
    wide = (cum[:, -1] <= TOP_P).nonzero().squeeze(1).tolist()                    # prefix not inside C
    if wide:
        n = len(wide)
        probs = transform_logits(logits[wide].float(), torch.full((n,), TEMPERATURE),
                                 torch.zeros(n, dtype=torch.int64), torch.full((n,), TOP_P),
                                 SamplingHints(truncate=True, any_greedy=False))  # [w, V]
        out[wide] = sample_from(probs, [gens[r] for r in wide])
    return out


class _Capture:
    """What the target computed for one static batch, kept per job (``answers.py --features``): the features of
    every position run and the top-k of the logits each answer token was picked from."""

    def __init__(self, st: _Batch, prompts: list[list[int]], feats, max_new: int, k: int):
        B, L = len(prompts), st.L
        self.prompt = [feats[b, L - len(p):] for b, p in enumerate(prompts)]      # [Lp, F] each
        self.dec = feats.new_zeros((B, max_new, feats.shape[-1]))                  # [B, T, F]: answer token t's
        self.top_i = torch.zeros((B, max_new, k), dtype=torch.int32)               # [B, T, k]: picking token t
        self.top_l = torch.zeros((B, max_new, k), dtype=torch.float16)
        self.k = k

    def topk(self, alive: list[int], t: int, logits) -> None:
        top = logits.topk(self.k, dim=-1)                                           # [B', k]
        self.top_i[alive, t] = top.indices.int()
        self.top_l[alive, t] = (top.values - logits.logsumexp(-1, keepdim=True)).half()   # log-probs

    def record(self, j: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Job j's answer of n tokens: (features of positions 0..Lp+n-2, top-k ids and log-probs [n, k])."""
        return torch.cat([self.prompt[j], self.dec[j, : n - 1]]), self.top_i[j, :n].clone(), self.top_l[j, :n].clone()


@torch.inference_mode()
def _generate_batch(model: LlamaModel, jobs, max_new: int, compact: float, layers: tuple[int, ...] = (),
                    k: int = 16) -> tuple[list[list[int]], _Capture | None]:
    """Answers for one batch of (prompt_ids, sampling) jobs, in order, and with ``layers`` what the target
    computed for them (``_Capture``)."""
    eos = torch.tensor(sorted(model.cfg.eos_token_ids) or [-1])
    st = _Batch(model, [p for p, _ in jobs], max_new)
    gens = [row_generator(p, s["variant"]) for p, s in jobs]
    L = st.L
    causal = torch.ones((L, L), dtype=torch.bool).tril()                          # [L, L]
    allowed = (causal & st.valid[:, None, :L]) | torch.eye(L, dtype=torch.bool)   # [B, L, L]: pads see themselves
    logits, feats = _forward(model, st, st.ids, st.pos, 0, allowed[:, None], layers)   # [B, V], [B, L, F]
    cap = _Capture(st, [p for p, _ in jobs], feats, max_new, k) if layers else None
    nxt = st.pos[:, -1] + 1                                                       # [B] next position
    answers: list[list[int]] = [[] for _ in jobs]
    alive = list(range(len(jobs)))                                                # job index of each batch row
    finished = torch.zeros(len(jobs), dtype=torch.bool)                           # [B] rows already complete
    for t in range(max_new):
        if cap is not None:
            cap.topk(alive, t, logits)
        tok = _pick(logits, [gens[j] for j in alive])                             # [B]
        for r, j in enumerate(alive):
            answers[j].append(int(tok[r]))
        finished |= torch.isin(tok, eos)
        if t + 1 == max_new or bool(finished.all()):
            break
        if finished.any() and int(finished.sum()) >= compact * len(alive):
            rows = (~finished).nonzero().squeeze(1)                               # [B']
            st.keep(rows)
            alive = [alive[r] for r in rows.tolist()]
            tok, nxt, finished = tok[rows], nxt[rows], finished[rows]
        allowed = st.valid[:, None, None, : L + t + 1]                            # [B, 1, 1, L+t+1]
        logits, feats = _forward(model, st, tok[:, None], nxt[:, None], L + t, allowed, layers)   # [B, V]
        if cap is not None:
            cap.dec[alive, t] = feats[:, 0]
        nxt = nxt + 1
    return [a[: _stop(a, eos)] for a in answers], cap


def _stop(ans: list[int], eos: torch.Tensor) -> int:
    """Length of an answer up to and including its first EOS (rows that finished early kept running)."""
    ids = set(eos.tolist())
    return next((i + 1 for i, t in enumerate(ans) if t in ids), len(ans))


def generate_answers(model: LlamaModel, jobs, batch: int = 64, max_new: int = 128, log=print,
                     compact: float = 0.25, layers: tuple[int, ...] = (), k: int = 16) -> list[dict]:
    """Answers to ``jobs`` = [(prompt_ids, {"variant": "greedy" | "s<seed>"})], in input order, as
    {"variant", "prompt_ids", "answer_ids"} (with ``layers``, "capture": ``_Capture.record``'s tensors too).
    Jobs run in batches of ``batch`` sorted by prompt length; a batch drops its finished rows when at least
    ``compact`` of the live rows are done."""
    order = sorted(range(len(jobs)), key=lambda j: len(jobs[j][0]))
    out: list[dict | None] = [None] * len(jobs)
    for i in range(0, len(order), batch):
        t0 = time.time()
        idx = order[i: i + batch]
        answers, cap = _generate_batch(model, [jobs[j] for j in idx], max_new, compact, layers, k)
        for b, (j, a) in enumerate(zip(idx, answers)):
            out[j] = {"variant": jobs[j][1]["variant"], "prompt_ids": list(jobs[j][0]), "answer_ids": a}
            if cap is not None:
                out[j]["capture"] = cap.record(b, len(a))
        n = sum(len(a) for a in answers)
        log(f"answers: batch {i // batch + 1}/{-(-len(order) // batch)}: {len(idx)} jobs, {n} tokens "
            f"in {time.time() - t0:.1f}s ({n / max(1e-9, time.time() - t0):.0f} tok/s)")
    return out


def build_answers(model: LlamaModel, jobs_with_ids, path: Path, chunk: int = 512, batch: int = 64,
                  max_new: int = 128, log=print, features: Path | None = None) -> list[dict]:
    """Append {"id", "variant", "prompt_ids", "answer_ids"} records for jobs = [(id, prompt_ids, sampling)]
    to ``path`` chunk by chunk; (id, variant) pairs already in the file are skipped, so a stopped run
    resumes. Pending jobs go in prompt-length order so each chunk's batches pad little. With ``features`` (a
    feature cache directory, training/eagle.py) the target's features and top-k of each record go there as
    it is generated (``CacheWriter``), so head training need not run the target over the corpus again."""
    have = _finished_lines(path)
    done = {(r["id"], r["variant"]) for r in have}
    todo = sorted((j for j in jobs_with_ids if (j[0], j[2]["variant"]) not in done), key=lambda j: len(j[1]))
    log(f"answers: {len(have)} on disk, {len(todo)} to generate")
    writer = _writer(model, features, have)
    t_all, n_all = time.time(), 0
    for i in range(0, len(todo), chunk):
        part = todo[i: i + chunk]
        t0 = time.time()
        cap = {"layers": writer.layers, "k": writer.k} if writer is not None else {}
        recs = generate_answers(model, [(p, s) for _, p, s in part], batch, max_new, log=log, **cap)
        recs = [{"id": jid, **r} for (jid, _, _), r in zip(part, recs)]
        for r in recs if writer is not None else ():
            writer.append(r["prompt_ids"] + r["answer_ids"], len(r["prompt_ids"]), *r.pop("capture"))
        with path.open("a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in recs))
        have.extend(recs)
        if writer is not None:
            writer.commit(len(have))
        n = sum(len(r["answer_ids"]) for r in recs)
        n_all += n
        log(f"answers: {len(have)}/{len(done) + len(todo)} ({n} tokens in {time.time() - t0:.0f}s, "
            f"{n / max(1e-9, time.time() - t0):.0f} tok/s; overall {n_all / (time.time() - t_all):.0f} tok/s)")
    if writer is not None:
        writer.close()
    return have


def _finished_lines(path: Path) -> list[dict]:
    """The records of the corpus's complete lines; a last line left unfinished by a stop inside a write is cut
    (its chunk is generated again)."""
    text = path.read_text() if path.exists() else ""
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
        with path.open("r+") as f:
            f.truncate(len(text.encode()))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _writer(model: LlamaModel, features: Path | None, have: list[dict]):
    """The feature cache's writer for a corpus that holds ``have`` (None without ``features``): the layers a
    head for this target reads (``HeadConfig.for_target``), the top-k head training uses."""
    if features is None:
        return None
    from nightjar.models.eagle import HeadConfig
    from nightjar.training.eagle import TOPK, CacheWriter

    layers = HeadConfig.for_target(model.cfg, 1).feature_layers
    return CacheWriter(features, [r for r in have if r["answer_ids"]], len(have), layers,
                       model.cfg.hidden_size, TOPK)


def main(argv=None) -> None:
    from nightjar.models import load_model
    from nightjar.training.distill import corpus_jobs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSONL file (appended to; a rerun resumes)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--templated", type=int, default=4000, help="templated prompts answered greedily")
    ap.add_argument("--samples", type=int, default=2, help="sampled answers per hand-written prompt")
    ap.add_argument("--passages", type=int, default=0,
                    help="then this many more prompts answered greedily: summarization/extraction tasks over "
                         "paragraphs of the templated answers, and chat requests (data/templated.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--limit", type=int, default=None, help="only the first N jobs")
    ap.add_argument("--features", default=None,
                    help="a feature cache dir (training/eagle.py --cache) to fill as the answers are generated")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (1 is faster on cores shared with other busy processes)")
    a = ap.parse_args(argv)
    if a.max_new < 1 or a.batch < 1 or a.chunk < 1 or a.passages < 0:
        ap.error("--max-new, --batch and --chunk must be >= 1, --passages >= 0")
    if a.features and Path(a.features).exists() and not Path(a.features).is_dir():
        ap.error(f"--features {a.features}: not a directory")
    if a.threads:
        torch.set_num_threads(a.threads)
    log = lambda s: print(f"[answers {time.strftime('%H:%M:%S')}] {s}", flush=True)  # noqa: E731
    target = load_model(a.model, dtype=torch.bfloat16, pack=False)
    jobs = corpus_jobs(a.templated, a.samples, a.seed)[: a.limit]
    chat = lambda p: target.tokenizer.encode_chat([{"role": "user", "content": p["prompt"]}])  # noqa: E731
    enc = [(p["id"], chat(p), {"variant": v}) for p, v in jobs]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    feats = Path(a.features) if a.features else None
    have = build_answers(target.model, enc, out, a.chunk, a.batch, a.max_new, log, feats)
    if a.passages:
        try:
            more = passage_prompts(passages_from(have, target.tokenizer.decode), a.passages, a.seed)
        except ValueError as e:             # the answers so far stay on disk; a rerun with a smaller N resumes
            ap.error(f"--passages {a.passages}: {e}")
        enc = [(p["id"], chat(p), {"variant": "greedy"}) for p in more]
        build_answers(target.model, enc, out, a.chunk, a.batch, a.max_new, log, feats)


def passages_from(records: list[dict], decode, lo: int = 40, hi: int = 160) -> list[str]:
    """Paragraphs for ``passage_prompts``: the greedy answers to templated prompts (ids ``tpl-``, in id order)
    decoded and split into lines; a line of prose (no code, no list item, no heading) cut after its last full
    stop is kept when it has ``lo``..``hi`` words."""
    out = []
    for r in sorted((r for r in records if r["id"].startswith("tpl-") and r["variant"] == "greedy"),
                    key=lambda r: r["id"]):
        for line in decode(r["answer_ids"]).splitlines():
            text = line.strip()
            text = text[: text.rfind(".") + 1]
            if "`" in text or text[:1] in "-*#|>0123456789" or not lo <= len(text.split()) <= hi:
                continue
            out.append(text)
    return out


if __name__ == "__main__":
    main()
