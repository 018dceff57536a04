"""The synthetic end-to-end bench (the last section of bench/gpu_check.sh) on its CPU smoke shapes."""
from __future__ import annotations

import re

from nightjar.bench.e2e_synthetic import main


def test_the_table_has_a_row_per_batch_and_detail_says_what_each_round_did(capsys):
    assert main(["--tokens", "4", "--reps", "1", "--policies", "fixed:2,nightjar", "--detail"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", out, re.M)
    assert [r[0] for r in rows] == ["1", "4"]                                 # the CPU smoke batches
    for _, fixed, nj, ratio in rows:                                          # nightjar / the best static, from
        f, n = float(fixed), float(nj)                                        # the unrounded rates: within the
        slack = 0.005 + n / f * (0.05 / n + 0.05 / f) + 1e-9                  # rounding of ratio (2 places) and
        assert abs(float(ratio) - n / f) <= slack                             # of the rates (1 place)
    assert out.count("steps by γ") == 4 and out.count("#   planner {") == 2    # nightjar's snapshot, per run
    assert re.search(r"fixed:2: steps by γ \{0: 1, 2: \d+\}", out)           # a prefill step, then γ = 2
    assert re.search(r"^# planner profile measured here in \d+ s", out, re.M)   # as `serve` reads its own
    assert out.count('"profile": "measured:random-small-target"') == 2


def test_without_a_profile_the_planner_runs_on_the_prior(capsys):
    assert main(["--tokens", "4", "--reps", "1", "--batches", "1", "--policies", "nightjar", "--profile", "none",
                 "--detail"]) == 0
    out = capsys.readouterr().out
    assert "planner profile" not in out and '"profile": null' in out


def test_a_failed_profile_measurement_is_said_and_the_planner_runs_on_the_prior(capsys, monkeypatch):
    import nightjar.bench.e2e_synthetic as e2e

    def fail(*_a, **_k):
        raise RuntimeError("no graphs today")
    monkeypatch.setattr(e2e, "build_profile", fail)
    assert main(["--tokens", "4", "--reps", "1", "--policies", "nightjar", "--detail"]) == 0
    out = capsys.readouterr().out
    assert "measuring failed (RuntimeError: no graphs today)" in out and '"profile": null' in out
