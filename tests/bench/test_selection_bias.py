"""bench/selection_bias.py: what the closed-loop protocol reads for a policy as fast as the static ones."""
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import selection_bias  # noqa: E402


def test_one_static_policy_is_unbiased_and_more_level_ones_read_lower():
    med = [float(np.median(selection_bias.reported_ratio(k, 0.05, 3, 20000))) for k in (1, 2, 4)]
    assert abs(med[0] - 1.0) < 0.005                      # nothing picked: an equal policy reads 1
    assert med[0] > med[1] > med[2] and med[2] < 0.985    # the noise-favoured pick of several reads high
    assert float(np.median(selection_bias.reported_ratio(4, 0.0, 3, 100))) == 1.0   # no noise, no bias


def _run(path: Path, series: dict[str, list[float]]) -> None:
    pol = {p: {"runs": [{"rep": i + 1, "output_throughput": x} for i, x in enumerate(xs)]} for p, xs in series.items()}
    path.write_text(json.dumps({"policies": pol}))


def test_sigma_comes_from_each_static_pair_about_its_own_mean(tmp_path):
    f = tmp_path / "run.json"
    base = [100.0, 90.0, 110.0, 95.0]
    # fixed:1 is 10 % below off in every repetition: a level offset, no spread, so sigma 0
    _run(f, {"off": base, "fixed:1": [0.9 * x for x in base], "nightjar": [1.0, 1.0, 1.0, 1.0]})
    assert selection_bias.sigma_from_run(str(f)) == pytest.approx(0.0, abs=1e-12)
    _run(f, {"off": [100.0, 100.0], "fixed:1": [100.0 * math.exp(0.1), 100.0 * math.exp(-0.1)]})
    assert selection_bias.sigma_from_run(str(f)) == pytest.approx(math.sqrt(0.02) / math.sqrt(2))


def test_the_table_and_cli_mistakes(tmp_path, capsys):
    assert selection_bias.main(["--statics", "1,3", "--sigmas", "0.04", "--trials", "2000"]) == 0
    rows = re.findall(r"^\| (\d) \| 0.040 \| ([\d.]+) \| ([\d.]+) \|$", capsys.readouterr().out, re.M)
    assert [r[0] for r in rows] == ["1", "3"]
    for bad in (["--statics", "x"], ["--sigmas", "-1"], ["--reps", "0"]):
        with pytest.raises(SystemExit) as e:
            selection_bias.main(bad)
        assert e.value.code == 2
    f = tmp_path / "one.json"
    _run(f, {"off": [1.0, 2.0], "nightjar": [1.0, 2.0]})
    for path in (f, tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as e:
            selection_bias.main(["--from-json", str(path)])
        assert e.value.code == 2
    assert "two static policies" in capsys.readouterr().err
