"""bench/head_candidates.py: the round arithmetic behind its estimates, on hand-made rank arrays."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
hc = pytest.importorskip("head_candidates")

from nightjar.actors.step_profile import Profile  # noqa: E402

# ranks [steps=3, entries=6]: the target's argmax is the head's top-1 (0), its second (1) or far below (9)
RANKS = np.array([[0, 1, 0, 9, 0, 0],
                  [0, 0, 9, 0, 0, 0],
                  [9, 0, 0, 0, 0, 0]])
CONF = np.array([[0.95, 0.3, 0.85, 0.05, 0.9, 0.9]] * 3)


def test_a_fixed_round_accepts_the_run_of_top1_hits():
    assert hc.chain_round(RANKS, CONF, 0, 3, 0, 0, None) == (3, 3, 3)   # steps 1, 2, 3 all hit
    assert hc.chain_round(RANKS, CONF, 0, 2, 0, 0, None) == (2, 2, 2)   # γ = 2: both
    assert hc.chain_round(RANKS, CONF, 1, 3, 0, 0, None) == (0, 3, 3)   # the first draft is the second choice
    assert hc.chain_round(RANKS, CONF, 5, 3, 0, 0, None) == (1, 1, 1)   # the answer ends after one draft


def test_stopping_keeps_and_drafts_only_while_the_product_is_high():
    cal = np.array([[0.1 * b + 0.05 for b in range(10)]] * 3)           # agreement = the bin's centre
    # entry 0: step 1 at p 0.95 is kept; step 2 (confidence 0.3) brings the product to 0.33: dropped, stop
    assert hc.chain_round(RANKS, CONF, 0, 3, 0.5, 0.5, cal) == (1, 1, 2)
    # entry 4: 0.95 * 0.95 = 0.90, then the answer ends: both kept, both hit
    assert hc.chain_round(RANKS, CONF, 4, 3, 0.5, 0.5, cal) == (2, 2, 2)
    # entry 1: 0.35 < 0.5 at once: one pass, nothing kept
    assert hc.chain_round(RANKS, CONF, 1, 3, 0.5, 0.5, cal) == (0, 0, 1)


def test_a_tree_round_accepts_when_the_target_token_is_among_the_candidates():
    assert hc.tree_round(RANKS, 1, 1, 2) == (0, 2, 2)                   # top-1 only: missed
    assert hc.tree_round(RANKS, 1, 2, 2) == (1, 4, 2)                   # second candidate hits, its chain not
    assert hc.tree_round(RANKS, 0, 2, 3) == (3, 6, 3)                   # top-1 hits and its chain twice
    assert hc.tree_round(RANKS, 3, 4, 3) == (0, 12, 3)                  # rank 9: no candidate matches
    for t in range(6):                                                  # width 1 is the plain chain
        assert hc.tree_round(RANKS, t, 1, 3)[0] == hc.chain_round(RANKS, CONF, t, 3, 0, 0, None)[0]


def test_calibration_counts_hits_by_confidence_bin():
    cal = hc.calibrate([(RANKS, CONF)], [0])
    assert cal[0, 9] == pytest.approx((3 + 1) / (3 + 2))                # 0.95, 0.9, 0.9: three hits
    assert cal[0, 0] == pytest.approx((0 + 1) / (1 + 2))                # 0.05: a miss


def test_past_the_grid_a_row_is_priced_as_more_rows():
    prof = Profile(name="t", B=[1, 2, 4], q=[1, 5], T=[[1.0, 1.0], [1.5, 2.0], [2.0, 3.0]], draft_B=[1],
                   draft_T=[0.1], prefill_s_per_token=0, catchup_c0=0, catchup_per_token=0, offload_s=0,
                   reload_s=0, draft_bytes=0, num_blocks=1, block_size=16, draft_blocks=0)
    assert hc.verify_time(prof, 1, 5) == 1.0
    assert hc.verify_time(prof, 1, 10) == prof.target_time(2, 5) == 2.0


@pytest.mark.parametrize("argv", [["--prompts", "1"], ["--steps", "0"], ["--batches", "0,4"], ["--batches", "x"],
                                  ["--profile", "/no/such/file"], ["--head", "/tmp"]])
def test_a_bad_option_ends_in_one_usage_line_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        hc.main(argv)
    assert e.value.code == 2 and ": error: --" in capsys.readouterr().err.strip().splitlines()[-1]
