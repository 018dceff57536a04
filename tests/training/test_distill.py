"""Distillation pieces on a tiny target: teacher top-k, soft-target loss, a short training run, saving."""
from __future__ import annotations

import json

import torch

from nightjar.models import LoadedModel
from nightjar.models.loader import load_weights
from nightjar.training.distill import (
    collate,
    dense_forward,
    draft_config,
    init_draft,
    kd_loss,
    save_draft,
    teacher_topk,
    train,
)
from tests.conftest import random_model, tiny_config


def tiny_corpus(target, n=8):
    g = torch.Generator().manual_seed(0)
    corpus = [{"id": f"p{i}", "prompt_ids": torch.randint(0, 100, (6 + i,), generator=g).tolist(),
               "answer_ids": torch.randint(0, 100, (5 + i % 3,), generator=g).tolist()} for i in range(n)]
    teacher_topk(LoadedModel(target, None, "t"), corpus, k=4)
    return corpus


def test_teacher_top_k_has_one_row_per_answer_token_and_sorted_log_probs():
    target = random_model(tiny_config(vocab=100, hidden=32), seed=0)
    for r in tiny_corpus(target):
        assert len(r["topk_ids"]) == len(r["answer_ids"]) and len(r["topk_ids"][0]) == 4
        assert all(a >= b for a, b in zip(r["topk_logp"][0], r["topk_logp"][0][1:]))


def test_a_short_training_run_lowers_the_loss_and_saves_a_transformers_loadable_draft(tmp_path):
    target = random_model(tiny_config(vocab=100, hidden=32), seed=0)
    corpus = tiny_corpus(target)
    cfg = draft_config(target.cfg, hidden=16, layers=1, inter=32, heads=2, kv_heads=1)
    draft = init_draft(cfg, target, seed=0)
    ids, tid, tlp, mask = collate(corpus, 64, 4)
    before = kd_loss(dense_forward(draft, ids, mask), tid, tlp, mask).item()
    state = train(draft, corpus, minutes=0.05, out=tmp_path, batch=4, log=lambda s: None)
    after = kd_loss(dense_forward(draft, ids, mask), tid, tlp, mask).item()
    assert state["step"] > 0 and after < before
    save_draft(draft, tmp_path / "draft", "# card\n")
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["hidden_size"] == 16
    ours = load_weights(tmp_path / "draft", torch.float32)
    assert torch.equal(ours.embed_tokens.weight, draft.embed_tokens.weight.to(torch.bfloat16).float())


def test_the_corpus_builds_in_chunks_and_a_rerun_resumes_without_regenerating(tiny_pair, tmp_path, monkeypatch):
    from nightjar.training import distill

    target, _ = tiny_pair
    jobs = [({"id": f"p{i}", "prompt": f"Say {i}."}, v) for i in range(3) for v in ("greedy", "s7")]
    path = tmp_path / "corpus.jsonl"
    monkeypatch.setattr(distill, "_params", lambda v: distill.SamplingParams(max_tokens=4, ignore_eos=True,
                        temperature=0.0 if v == "greedy" else 0.8, seed=7))
    first = distill.build_corpus(target, jobs[:4], path, log=lambda s: None, chunk=3)
    assert [(r["id"], r["variant"]) for r in first] == [(p["id"], v) for p, v in jobs[:4]]
    assert all(len(r["answer_ids"]) == 4 == len(r["topk_ids"]) for r in first)
    lines = path.read_text().splitlines()
    generated = []
    real = distill._answers
    monkeypatch.setattr(distill, "_answers", lambda eng, todo: generated.extend(todo) or real(eng, todo))
    again = distill.build_corpus(target, jobs, path, log=lambda s: None, chunk=3)
    assert generated == jobs[4:]                                  # only the missing jobs ran
    assert path.read_text().splitlines()[:4] == lines and len(again) == 6


def test_templated_prompts_are_distinct_training_prompts():
    from nightjar.data import load_prompts
    from nightjar.data.templated import templated_prompts

    recs = templated_prompts(3000, seed=0)
    assert len({r["prompt"] for r in recs}) == 3000 and {r["split"] for r in recs} == {"train"}
    assert recs == templated_prompts(3000, seed=0)
    assert not {r["prompt"] for r in recs} & {r["prompt"] for r in load_prompts(split="heldout")}


def test_top1_agreement_is_one_for_the_teacher_itself_and_split_by_source():
    from nightjar.training.distill import top1_agreement

    target = random_model(tiny_config(vocab=100, hidden=32), seed=0)
    corpus = tiny_corpus(target)
    for r in corpus[:3]:
        r["id"] = "tpl-" + r["id"]
    same = top1_agreement(target, corpus, batch=3)      # bf16 autocast: near-ties of a random model may flip
    assert set(same) == {"hand-written", "templated"} and all(v > 0.9 for v in same.values())
    other = random_model(tiny_config(vocab=100, hidden=32), seed=1)
    got = top1_agreement(other, corpus)
    assert all(0 <= v < 0.5 for v in got.values())


def test_passage_prompts_are_distinct_deterministic_and_cover_the_other_kinds():
    import pytest

    from nightjar.data.templated import is_templated, passage_prompts

    passages = [f"Paragraph {i} says something about topic {i}. It has a second sentence." for i in range(40)]
    recs = passage_prompts(passages, 500, seed=3)
    assert recs == passage_prompts(passages, 500, seed=3) and recs != passage_prompts(passages, 500, seed=4)
    assert len({r["prompt"] for r in recs}) == 500 and all(is_templated(r["id"]) for r in recs)
    assert {r["category"] for r in recs} >= {"summarization", "extraction", "chat"}
    with_passage = [r for r in recs if r["category"] != "chat"]
    assert with_passage and all(r["prompt"].split("\n\n", 1)[1] in passages for r in with_passage)
    assert not is_templated("chat-0001")
    with pytest.raises(ValueError, match="asked for"):
        passage_prompts(passages, 10_000)
