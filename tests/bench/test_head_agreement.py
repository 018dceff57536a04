"""bench/head_agreement.py: how one answer's per-step hits are counted (agreement and fixed:1 rounds)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
ha = pytest.importorskip("head_agreement")
HEAD = Path(__file__).resolve().parents[2] / "nightjar/models/drafts/smollm2-135m-head"


def test_step_j_counts_from_entry_j_and_an_accepted_draft_skips_a_position():
    hits = [torch.tensor([True, False, True, True, False]),     # step 0: 3 of 5
            torch.tensor([True, True, False, True, True])]      # step 1: entries 1.. -> 3 of 4
    per_step, rounds = [[0, 0], [0, 0]], [0, 0]
    ha.tally(hits, 2, per_step, rounds)
    assert per_step == [[3, 5], [3, 4]]
    # fixed:1 rounds over step 0: hit at 0 (skip 1), hit at 2 (skip 3), miss at 4 -> 2 accepted of 3 rounds
    assert rounds == [2, 3]
    ha.tally(hits, 2, per_step, rounds)                           # a second answer adds to the same counts
    assert per_step == [[6, 10], [6, 8]] and rounds == [4, 6]


def test_a_bad_head_or_size_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ha.main(["--head", str(tmp_path)])
    assert e.value.code == 2 and "not a draft head directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        ha.main(["--head", str(HEAD), "--prompts", "-1"])
    assert e.value.code == 2 and "--prompts" in capsys.readouterr().err


def test_first_position_hits_fall_in_the_bin_of_the_targets_confidence():
    bins = [[0, 0] for _ in ha.CONFIDENCE_EDGES[1:]]
    conf = torch.tensor([0.1, 0.3, 0.49, 0.95, 1.0, 0.7])
    ha.tally_confidence(torch.tensor([False, True, False, True, True, True]), conf, bins)
    # [0,.3): 0.1 | [.3,.5): 0.3, 0.49 | [.5,.7): - | [.7,.9): 0.7 | [.9,1]: 0.95, 1.0
    assert bins == [[0, 1], [1, 2], [0, 0], [1, 1], [2, 2]]


def test_corpus_mode_reads_the_greedy_answers_of_the_validation_split_cut_to_max_tokens(tmp_path):
    import json

    lines = []
    for i in range(40):                                      # ids qa-00 .. tpl-39: every 20th sorted id validates
        for variant in ("greedy", "s0"):
            lines.append({"id": f"{'tpl' if i % 2 else 'qa'}-{i:02d}", "variant": variant, "prompt_ids": [1, i],
                          "answer_ids": list(range(10))})
    corpus = tmp_path / "answers.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in lines))
    got = ha.validation_answers(corpus, 0, 4)
    # sorted ids: qa-00, qa-02, .., qa-38, tpl-01, .., tpl-39 -> the 0th (qa-00) and 20th (tpl-01) validate
    assert got == [("qa", [1, 0], [0, 1, 2, 3]), ("tpl", [1, 1], [0, 1, 2, 3])]
    assert ha.validation_answers(corpus, 1, 4) == got[:1]


def test_a_missing_corpus_or_one_that_is_no_answers_corpus_exits_2_before_the_model_loads(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        ha.main(["--head", str(HEAD), "--corpus", str(tmp_path / "none.jsonl")])
    assert e.value.code == 2 and "no such file" in capsys.readouterr().err
    for text in ("not json\n", '{"id": "qa-0"}\n', "[1, 2]\n"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(SystemExit) as e:
            ha.main(["--head", str(HEAD), "--corpus", str(bad), "--model", str(tmp_path / "no-model")])
        assert e.value.code == 2 and "not an answers corpus" in capsys.readouterr().err
