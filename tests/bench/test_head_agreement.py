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
