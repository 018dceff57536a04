"""The batched answer generator on a tiny random target: greedy answers match an unbatched reference,
sampled answers are seeded, and the JSONL writer resumes."""
from __future__ import annotations

import json

import torch

from nightjar.training.answers import build_answers, generate_answers
from nightjar.training.distill import dense_forward
from tests.conftest import random_model, tiny_config

MAX_NEW = 12


def tiny_target():
    return random_model(tiny_config(vocab=128, hidden=32, eos=(98,)), seed=3, std=0.3)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 9, 5, 14, 1)]


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """Full forward over the growing sequence, argmax of the last position, stop at EOS (kept)."""
    seq, out = list(prompt), []
    for _ in range(max_new):
        tok = int(dense_forward(model, torch.tensor([seq]))[0, -1].argmax())
        out.append(tok)
        seq.append(tok)
        if tok in model.cfg.eos_token_ids:
            break
    return out


def test_greedy_answers_equal_an_unbatched_reference_token_for_token():
    model = tiny_target()
    ps = prompts()
    got = generate_answers(model, [(p, {"variant": "greedy"}) for p in ps], batch=3, max_new=MAX_NEW,
                           log=lambda s: None)
    want = [reference_greedy(model, p, MAX_NEW) for p in ps]
    assert [r["answer_ids"] for r in got] == want
    assert [r["prompt_ids"] for r in got] == ps
    assert any(len(a) < MAX_NEW for a in want) and any(len(a) == MAX_NEW for a in want)  # both stop rules ran


def test_compacting_the_batch_changes_no_greedy_answer():
    model = tiny_target()
    jobs = [(p, {"variant": "greedy"}) for p in prompts()]
    never = generate_answers(model, jobs, batch=5, max_new=MAX_NEW, log=lambda s: None, compact=2.0)
    always = generate_answers(model, jobs, batch=5, max_new=MAX_NEW, log=lambda s: None, compact=0.0)
    assert [r["answer_ids"] for r in never] == [r["answer_ids"] for r in always]


def test_sampled_answers_are_deterministic_per_seed_and_differ_across_seeds():
    model = tiny_target()
    ps = prompts()

    def run(seed, batch):
        jobs = [(p, {"variant": f"s{seed}"}) for p in ps]
        return [r["answer_ids"] for r in generate_answers(model, jobs, batch=batch, max_new=MAX_NEW,
                                                          log=lambda s: None)]
    a, b = run(0, 3), run(0, 2)          # other batch compositions, same tokens
    assert a == b
    assert run(1, 3) != a
    greedy = [r["answer_ids"] for r in generate_answers(model, [(p, {"variant": "greedy"}) for p in ps],
                                                        batch=3, max_new=MAX_NEW, log=lambda s: None)]
    assert a != greedy


def test_the_writer_appends_records_and_a_rerun_skips_finished_jobs(tmp_path):
    model = tiny_target()
    ps = prompts()
    jobs = [(f"p{i}", p, {"variant": v}) for i, p in enumerate(ps) for v in ("greedy", "s7")]
    path = tmp_path / "answers.jsonl"
    build_answers(model, jobs[:4], path, chunk=3, batch=2, max_new=4, log=lambda s: None)
    first = [json.loads(line) for line in path.read_text().splitlines()]
    assert {(r["id"], r["variant"]) for r in first} == {(j[0], j[2]["variant"]) for j in jobs[:4]}
    assert set(first[0]) == {"id", "variant", "prompt_ids", "answer_ids"}
    with path.open("a") as f:
        f.write(path.read_text().splitlines()[0][:15])                       # a stop inside a write
    logs = []
    have = build_answers(model, jobs, path, chunk=3, batch=2, max_new=4, log=logs.append)
    assert logs[0] == "answers: 4 on disk, 6 to generate"                    # the unfinished line cut
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[:4] == first and len(lines) == len(have) == len(jobs)
    assert sorted((r["id"], r["variant"]) for r in lines) == sorted((j[0], j[2]["variant"]) for j in jobs)
    by_key = {(r["id"], r["variant"]): r for r in lines}
    assert all(by_key[(j, s["variant"])]["prompt_ids"] == p for j, p, s in jobs)


class _Stop(Exception):
    pass


def _stop_at(prefix: str):
    def log(msg: str) -> None:
        if msg.startswith(prefix):
            raise _Stop(msg)
    return log


def _run(model, jobs, path, log, features=None) -> None:
    try:
        build_answers(model, jobs, path, chunk=6, batch=6, max_new=MAX_NEW, log=log, features=features)
    except _Stop:
        pass


def test_features_captured_while_generating_equal_the_targets_fill_and_survive_stops(tmp_path, monkeypatch):
    """A corpus of 15 answers in chunks of 6: begun without features (stopped after 6), resumed with them into a
    directory holding another corpus's cache and stopped inside the third chunk's commit (records 13-15 written,
    not committed), then rerun with nothing left to generate. The cache holds every record, the 9 without
    features uncached (the fill runs exactly them), and what was captured equals what the target's dense
    forward computes over the same records."""
    from nightjar.models.eagle import HeadConfig
    from nightjar.training.eagle import CacheWriter, build_cache, capture_stats, fill_cache, open_cache, read_corpus

    model, path, d = tiny_target(), tmp_path / "answers.jsonl", tmp_path / "cache"
    jobs = [(f"p{i}", p, {"variant": v}) for i, p in enumerate(prompts()) for v in ("greedy", "s7", "s8")]
    layers = HeadConfig.for_target(model.cfg, 1).feature_layers
    other = [{"id": "x", "variant": "greedy", "prompt_ids": [5, 6, 7], "answer_ids": [8] * 30}]
    build_cache(model, other, layers, d, log=lambda s: None)                    # another corpus's full cache
    _run(model, jobs, path, _stop_at("answers: 6/"))
    commit, calls = CacheWriter.commit, []

    def stop_third(self, lines):
        calls.append(lines)
        if len(calls) == 3:
            raise _Stop("in commit")
        commit(self, lines)
    monkeypatch.setattr(CacheWriter, "commit", stop_third)
    _run(model, jobs, path, lambda s: None, features=d)
    monkeypatch.setattr(CacheWriter, "commit", commit)
    assert calls == [6, 12, 15]
    _run(model, jobs, path, lambda s: None, features=d)
    recs, lines = read_corpus(path)
    cache = open_cache(d, recs, layers, 32, lines=lines)
    assert len(recs) == len(jobs) and cache.cached.tolist() == [False] * 6 + [True] * 6 + [False] * 3
    assert capture_stats(d)["tokens"] == int(cache.lengths[6:12].sum())
    assert fill_cache(model, cache, recs, log=lambda s: None) == int(cache.lengths.sum() - cache.lengths[6:12].sum())
    fresh = build_cache(model, recs, layers, tmp_path / "fresh", log=lambda s: None)
    for r in range(len(recs)):
        o, S, lo = int(cache.offsets[r]), int(cache.lengths[r]), int(cache.prompt_lens[r]) - 1
        assert (cache.tokens[o: o + S] == fresh.tokens[o: o + S]).all()
        torch.testing.assert_close(torch.from_numpy(cache.feats[o: o + S - 1]).view(torch.bfloat16),
                                   torch.from_numpy(fresh.feats[o: o + S - 1]).view(torch.bfloat16),
                                   atol=1e-2, rtol=1e-2)
        assert (cache.topk_ids[o + lo: o + S - 1] == fresh.topk_ids[o + lo: o + S - 1]).all()
        torch.testing.assert_close(torch.from_numpy(cache.topk_logp[o + lo: o + S - 1]).float(),
                                   torch.from_numpy(fresh.topk_logp[o + lo: o + S - 1]).float(), atol=2e-3, rtol=0)


def test_the_cli_rejects_a_size_below_one_and_a_features_file_with_exit_2(tmp_path, capsys):
    import pytest

    from nightjar.training.answers import main

    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "a.jsonl"), "--max-new", "0"])
    assert e.value.code == 2 and "--max-new" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "a.jsonl"), "--passages", "-1"])
    assert e.value.code == 2 and "--passages" in capsys.readouterr().err
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["--out", str(tmp_path / "a.jsonl"), "--features", str(tmp_path / "f")])
    assert e.value.code == 2 and "not a directory" in capsys.readouterr().err


def test_passages_are_the_prose_lines_of_templated_greedy_answers():
    from nightjar.training.answers import passages_from

    prose = " ".join(["word"] * 45) + ". A trailing half"
    texts = {1: f"Intro line.\n{prose}", 2: f"- {prose}", 3: f"Use `x`: {prose}", 4: prose, 5: prose}
    recs = [{"id": "tpl-00002", "variant": "greedy", "answer_ids": [1]},
            {"id": "tpl-00001", "variant": "greedy", "answer_ids": [4]},
            {"id": "tpl-00003", "variant": "greedy", "answer_ids": [2]},
            {"id": "tpl-00004", "variant": "greedy", "answer_ids": [3]},
            {"id": "tpl-00005", "variant": "s0", "answer_ids": [5]},
            {"id": "chat-0001", "variant": "greedy", "answer_ids": [5]}]
    got = passages_from(recs, lambda ids: texts[ids[0]], lo=40, hi=60)
    assert got == [prose[: prose.rfind(".") + 1]] * 2         # tpl-00001, then tpl-00002's second line
    assert passages_from(recs, lambda ids: texts[ids[0]], lo=50, hi=60) == []


def test_more_passages_than_the_answers_give_exit_2_after_keeping_the_answers(tmp_path, capsys, monkeypatch):
    import pytest

    from nightjar.training import answers

    target = tiny_target()

    class Tok:
        def encode_chat(self, messages):
            return [1, 2, 3]

        def decode(self, ids):
            return "short."
    monkeypatch.setattr("nightjar.models.load_model", lambda *a, **k: type("T", (), {"model": target,
                                                                                       "tokenizer": Tok()})())
    out = tmp_path / "a.jsonl"
    with pytest.raises(SystemExit) as e:
        answers.main(["--out", str(out), "--templated", "2", "--samples", "0", "--limit", "3", "--max-new", "2",
                      "--passages", "1000000"])
    assert e.value.code == 2 and "--passages 1000000: only" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 3                  # the answers generated first are kept
