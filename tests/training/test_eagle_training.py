"""EAGLE-3 head training on a tiny random target (fp32): dense features, label alignment, the unrolled
training-time test against the head's paged inference, vocabulary selection, a short run and resume."""
from __future__ import annotations

import json

import torch

from nightjar.kvpool.cache import KVCache
from nightjar.models import build_layout
from nightjar.models.eagle import DraftHead, HeadConfig, load_head
from nightjar.training.eagle import (
    PickedLogProbs,
    TrainSetup,
    _bucketed_order,
    _epoch_order,
    batch_loss,
    bf16_copy,
    build_cache,
    collate,
    coverage,
    dense_target,
    fill_cache,
    fill_stats,
    init_head,
    open_cache,
    read_corpus,
    save_head,
    select_vocab,
    set_standardisation,
    step_loss,
    target_to_draft,
    train,
    ttt_forward,
)
from tests.conftest import random_model, tiny_config

LAYERS = (0, 1, 3)


def tiny_target():
    return random_model(tiny_config(vocab=100, hidden=32, layers=4), seed=0)


def greedy_records(target, n=6, answer=7):
    """Random prompts answered greedily by the target (so its argmax at position q is x_{q+1})."""
    g = torch.Generator().manual_seed(0)
    recs = []
    for i in range(n):
        ids = torch.randint(0, 100, (5 + i,), generator=g).tolist()
        seq = list(ids)
        for _ in range(answer):
            _, logits = dense_target(target, torch.tensor([seq]), LAYERS)
            seq.append(int(logits[0, -1].argmax()))
        recs.append({"id": f"p{i}", "variant": "greedy", "prompt_ids": ids, "answer_ids": seq[len(ids):]})
    return recs


def test_dense_target_features_and_logits_equal_the_paged_capture():
    target = tiny_target()
    seqs = [[3, 14, 15, 92, 65, 35, 89], [7, 9, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    bs = 4
    tables = [tuple(range(0, 3)), tuple(range(3, 6)), tuple(range(6, 9))]
    lay = build_layout(seqs, [0, 0, 0], tables, bs, [len(s) for s in seqs])
    cache = KVCache(4, 2, 8, bs, 9, torch.float32)
    logits, feats = target(lay, cache, capture=LAYERS)                          # [T, V], [T, 3H]
    ids = torch.zeros((3, 11), dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
    dfeats, dlogits = dense_target(target, ids, LAYERS)
    flat = torch.cat([dfeats[b, : len(s)] for b, s in enumerate(seqs)])
    flat_logits = torch.cat([dlogits[b, : len(s)] for b, s in enumerate(seqs)])
    assert feats.shape == flat.shape == (sum(map(len, seqs)), 3 * 32)
    torch.testing.assert_close(flat, feats, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(flat_logits, logits, atol=1e-4, rtol=1e-4)


def test_head_position_p_reads_x_p_plus_1_and_is_labelled_with_the_target_at_p_plus_1(tmp_path):
    target = tiny_target()
    recs = greedy_records(target)
    cache = build_cache(target, recs, LAYERS, tmp_path / "cache", k=4, log=lambda s: None)
    b = collate(cache, [0, 3], max_len=64)
    for row, r in enumerate([recs[0], recs[3]]):
        x = r["prompt_ids"] + r["answer_ids"]
        S, Lp = len(x), len(r["prompt_ids"])
        feats, _ = dense_target(target, torch.tensor([x]), LAYERS)
        assert b.positions[row, : S - 1].tolist() == list(range(S - 1))
        assert b.emb_ids[row, : S - 1].tolist() == x[1:]                          # e_{p+1}
        torch.testing.assert_close(b.feats[row, : S - 1].float(), feats[0, : S - 1], atol=1e-3, rtol=1e-2)
        trained = b.mask[row].nonzero().squeeze(1).tolist()
        assert trained == list(range(Lp - 2, S - 2))                              # x_{p+2} is an answer token
        # greedy answers: the target's argmax at p+1 is exactly the token the head must predict, x_{p+2}
        assert [int(b.lab_ids[row, p, 0]) for p in trained] == x[Lp: S]
    assert not b.mask[0, len(recs[0]["prompt_ids"] + recs[0]["answer_ids"]) - 1:].any()   # padding


class _Stop(Exception):
    pass


def test_a_stopped_cache_fill_resumes_where_it_left_and_counts_every_token_once(tmp_path):
    target, d = tiny_target(), tmp_path / "cache"
    recs = greedy_records(target, n=6)

    def stop_after_first(msg):
        raise _Stop(msg)
    cache = open_cache(d, recs, LAYERS, 32, k=4)
    try:
        fill_cache(target, cache, recs, log=stop_after_first, chunk=2, flag_seconds=0.0)
    except _Stop:
        pass
    assert sorted(open_cache(d, recs, LAYERS, 32, k=4).cached.nonzero()[0].tolist()) == [0, 1]   # shortest
    logs = []
    cache = open_cache(d, recs, LAYERS, 32, k=4)
    ran = fill_cache(target, cache, recs, log=logs.append, chunk=2, flag_seconds=0.0)
    assert cache.cached.all() and ran == int(cache.lengths[2:].sum()) and len(logs) == 2
    assert fill_stats(cache)["tokens"] == int(cache.lengths.sum()) and fill_stats(cache)["seconds"] > 0
    fresh = build_cache(target, recs, LAYERS, tmp_path / "fresh", k=4, log=lambda s: None)
    assert (cache.tokens == fresh.tokens).all() and (cache.topk_ids == fresh.topk_ids).all()
    torch.testing.assert_close(torch.from_numpy(cache.feats[:]).view(torch.bfloat16),   # other padding: not bit-equal
                               torch.from_numpy(fresh.feats[:]).view(torch.bfloat16), atol=1e-2, rtol=1e-2)
    assert fill_cache(target, cache, recs, log=logs.append) == 0 and len(logs) == 2
    assert fill_stats(open_cache(d, recs[:5], LAYERS, 32, k=4))["tokens"] == 0   # another corpus: a new cache


def random_head(target, vocab=40, seed=1) -> DraftHead:
    hc = HeadConfig.for_target(target.cfg, vocab, LAYERS)
    head = init_head(hc, target.lm_head.weight.detach(), torch.arange(0, 2 * vocab, 2), seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
        head.feat_shift.copy_(torch.randn(hc.feature_size, generator=g))
        head.feat_scale.copy_(torch.rand(hc.feature_size, generator=g) + 0.5)
    return head.eval()


def test_unrolled_training_steps_compute_what_paged_inference_computes():
    target = tiny_target()
    head = random_head(target)
    x = [5, 17, 42, 8, 99, 23, 61, 4, 30, 12, 77, 50, 9]
    S, K = len(x) - 1, 4                                                         # head positions 0..S-1
    feats, _ = dense_target(target, torch.tensor([x]), LAYERS)
    emb = target.embed_tokens(torch.tensor([x[1:]]))                             # [1, S, H]
    with torch.no_grad():
        outs = ttt_forward(head, feats[:, :S], emb, torch.arange(S)[None], K)
    table = tuple(range(8))
    for n in range(1, S - K + 2):                                                # anchor n-1 (committed 0..n-1)
        cache = KVCache(1, head.cfg.num_kv_heads, head.cfg.head_dim, 4, 8, torch.float32)
        lay = build_layout([x[:n]], [0], [table], 4, [n])
        a, _ = head(lay, cache, emb[0, :n], head.fuse(feats[0, :n]))
        torch.testing.assert_close(a[-1], outs[0][0, n - 1], atol=1e-4, rtol=1e-4)
        for j in range(1, K):                                                    # draft step j at p = n-1+j
            p = n - 1 + j
            if p >= S:
                break
            lay = build_layout([[x[p]]], [p], [table], 4, [1])
            a, _ = head(lay, cache, emb[0, p: p + 1], a[-1:])
            torch.testing.assert_close(a[-1], outs[j][0, p], atol=1e-4, rtol=1e-4)


def test_vocabulary_is_the_most_frequent_ids_sorted_and_maps_both_ways():
    counts = torch.tensor([5, 0, 9, 1, 7, 0, 3, 2])
    d2t = select_vocab(counts, 4)
    assert d2t.tolist() == [0, 2, 4, 6]
    assert abs(coverage(counts, d2t) - 24 / 27) < 1e-9
    t2d = target_to_draft(d2t, 8)
    assert t2d.tolist() == [0, -1, 1, -1, 2, -1, 3, -1]
    head = init_head(HeadConfig.for_target(tiny_config(vocab=8, hidden=16, layers=2), 4), torch.randn(8, 16), d2t, 0)
    assert head.to_target_ids(torch.tensor([3, 1])).tolist() == [6, 2]


def test_a_bucketed_epoch_is_whole_batches_of_distinct_rows_with_less_padding_than_a_random_one():
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(20, 400, (1000,), generator=g).tolist()
    order = _bucketed_order(lengths, seed=3, epoch=2, batch=8)
    assert order == _bucketed_order(lengths, seed=3, epoch=2, batch=8)              # a resumed epoch repeats it
    assert len(order) % 8 == 0 and len(set(order)) == len(order) >= 1000 - 8
    assert order != _bucketed_order(lengths, seed=3, epoch=3, batch=8)

    def padded(o):
        return sum(8 * max(lengths[r] for r in o[i: i + 8]) for i in range(0, len(o) - 7, 8))
    plain = _epoch_order(1000, 3, 2)[: len(order)]
    assert padded(order) < 0.8 * padded(plain)
    assert abs(sum(lengths[r] for r in order[: len(order) // 2]) / sum(lengths[r] for r in order) - 0.5) < 0.1


def _setup(target, tmp_path, vocab=40):
    """A setup whose cache the target fills on first use (records 0 and 1 up front, for the standardisation)."""
    recs = greedy_records(target, n=8)
    cache = open_cache(tmp_path / "cache", recs, LAYERS, 32, k=4)
    d2t = select_vocab(torch.bincount(torch.tensor([t for r in recs for t in r["answer_ids"]]), minlength=100), vocab)
    head = init_head(HeadConfig.for_target(target.cfg, vocab, LAYERS), target.lm_head.weight.detach(), d2t, 0)
    setup = TrainSetup(cache, list(range(8)), [], target.embed_tokens.weight.detach(), target_to_draft(d2t, 100),
                       target, recs)
    setup.ready([0, 1])
    set_standardisation(head, cache, [0, 1])
    return head, setup


def test_a_short_run_lowers_the_loss_and_a_rerun_resumes_the_step_count(tmp_path):
    target = tiny_target()
    head, setup = _setup(target, tmp_path)
    assert setup.cache.cached.tolist() == [True, True] + [False] * 6
    setup.ready(list(range(8)))
    b = collate(setup.cache, list(range(8)), 64)
    with torch.no_grad():
        before = float(batch_loss(head, b, setup.emb_table, setup.t2d, 3)[0])
    state = train(head, setup, minutes=5, out=tmp_path, steps=3, lr=3e-3, batch=4, max_steps=30, warmup=1,
                  log=lambda s: None)
    with torch.no_grad():
        after = float(batch_loss(head, b, setup.emb_table, setup.t2d, 3)[0])
    assert state["step"] == 30 and after < before
    again, setup = _setup(target, tmp_path)
    assert setup.cache.cached.all()                                              # the reopened cache is reused
    logs = []
    state = train(again, setup, minutes=5, out=tmp_path, steps=3, lr=3e-3, batch=4, max_steps=34, warmup=1,
                  log=logs.append)
    assert logs[0] == "resumed at step 30 (epoch 15)" and state["step"] == 34
    save_head(bf16_copy(again), tmp_path / "head", "# card\n")
    loaded = load_head(tmp_path / "head", target.cfg, torch.bfloat16)
    assert torch.equal(loaded.fc.weight, again.fc.weight.bfloat16())
    assert torch.equal(loaded.d2t, again.d2t) and torch.equal(loaded.feat_scale, again.feat_scale)


def test_the_corpus_reader_skips_empty_answers_and_a_line_still_being_written(tmp_path):
    path = tmp_path / "answers.jsonl"
    rec = {"id": "a", "variant": "greedy", "prompt_ids": [1, 2], "answer_ids": [3]}
    path.write_text(json.dumps(rec) + "\n" + json.dumps({**rec, "answer_ids": []}) + "\n" + json.dumps(rec)[:9])
    recs, lines = read_corpus(path)
    assert recs == [rec] and lines == 2
    assert read_corpus(path, limit=1) == ([rec], 1)


def test_picked_log_probs_and_their_gradient_equal_log_softmax_then_gather():
    g = torch.Generator().manual_seed(0)
    z = (3 * torch.randn(7, 50, generator=g)).requires_grad_()
    ids = torch.randint(0, 50, (7, 5), generator=g)
    ids[:, 3] = ids[:, 4] = 0                                   # repeated ids (out-of-vocabulary rows clamp to 0)
    w = torch.randn(7, 5, generator=g)
    picked, zmax = PickedLogProbs.apply(z, ids)
    (picked * w).sum().backward()
    ref_z = z.detach().clone().requires_grad_()
    ref = ref_z.log_softmax(-1).gather(-1, ids)
    (ref * w).sum().backward()
    assert torch.allclose(picked, ref, atol=1e-5)
    assert torch.allclose(z.grad, ref_z.grad, atol=1e-5)
    assert torch.equal(zmax, z.detach().amax(-1))


def test_step_loss_hits_are_the_heads_argmax_equal_to_the_targets_in_vocabulary():
    hc = HeadConfig(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8,
                    feature_layers=LAYERS, draft_vocab=20, target_vocab=100)
    head = DraftHead(hc)
    d2t = torch.arange(0, 100, 5)                                # draft id i <-> target id 5i
    head.d2t.copy_(d2t)
    t2d = target_to_draft(d2t, 100)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 6, 32, generator=g)
    mask = torch.ones(2, 6, dtype=torch.bool)
    lab = torch.randint(0, 100, (2, 6, 4), generator=g)
    lab[0, :, 0] = head.d2t[head.logits(a[0]).argmax(-1)]        # row 0: the target's argmax is the head's
    lab[1, :3, 0] = 1                                            # outside the draft vocabulary: never a hit
    loss, hits = step_loss(head, a, mask, lab, torch.randn(2, 6, 4, generator=g), t2d)
    want = head.d2t[head.logits(a.reshape(12, 32)).argmax(-1)] == lab.reshape(12, 4)[:, 0]
    assert torch.isfinite(loss) and torch.equal(hits, want) and bool(hits[:6].all()) and not bool(hits[6:9].any())


def test_the_training_cli_rejects_a_missing_corpus_and_a_bad_size_with_exit_2(tmp_path, capsys):
    import pytest

    from nightjar.training.eagle import main

    corpus = tmp_path / "answers.jsonl"
    corpus.write_text("")
    for argv, said in ((["--corpus", str(tmp_path / "none.jsonl")], "no such file"),
                       (["--corpus", str(corpus), "--vocab", "0"], "--vocab must be > 0"),
                       (["--corpus", str(corpus), "--intermediate", "-1"], "--intermediate must be > 0"),
                       (["--corpus", str(corpus), "--intermediate", "0"], "--intermediate must be > 0"),
                       (["--corpus", str(corpus), "--max-steps", "-5"], "--max-steps must be > 0"),
                       (["--corpus", str(corpus), "--max-steps", "0"], "--max-steps must be > 0"),
                       (["--corpus", str(corpus), "--cache", str(corpus)], "not a directory")):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--out", str(tmp_path / "out")])
        assert e.value.code == 2 and said in capsys.readouterr().err


def test_the_schedule_follows_whichever_budget_ends_the_run_first():
    from nightjar.training.eagle import schedule_progress

    assert schedule_progress(30 * 60, 60, 10, None) == 0.5              # wall time only
    assert schedule_progress(30 * 60, 60, 750, 1000) == 0.75            # steps ahead of the clock
    assert schedule_progress(45 * 60, 60, 100, 1000) == 0.75            # the clock ahead of the steps
    assert schedule_progress(90 * 60, 60, 2000, 1000) == 1.0


def test_a_head_with_a_wider_mlp_saves_and_loads_with_its_width(tmp_path):
    from dataclasses import replace

    from nightjar.models.eagle import save_head

    cfg = tiny_config(vocab=8, hidden=16, layers=2)
    hc = replace(HeadConfig.for_target(cfg, 4), intermediate_size=3 * cfg.intermediate_size)
    head = init_head(hc, torch.randn(8, 16), torch.tensor([0, 2, 5, 7]), 0)
    save_head(head, tmp_path)
    back = load_head(tmp_path, cfg, torch.float32)
    assert back.mlp.up_proj.weight.shape == (3 * cfg.intermediate_size, 16)
    assert all(torch.equal(a, b) for a, b in zip(head.state_dict().values(), back.state_dict().values()))


def test_the_model_cards_reproduce_line_names_the_width_and_the_step_bound():
    from argparse import Namespace

    from nightjar.training.eagle import _extra_flags, _schedule_note

    wide = Namespace(max_len=512, drop_oov=False, intermediate=3072, max_steps=4906)
    assert _extra_flags(wide) == " --intermediate 3072 --max-steps 4906"
    assert _schedule_note(wide).startswith("the learning-rate schedule follows steps")
    plain = Namespace(max_len=512, drop_oov=False, intermediate=None, max_steps=None)
    assert _extra_flags(plain) == "" and "follows wall time" in _schedule_note(plain)
