"""bench/catchup_outlier.py: the planner-only simulation behind docs/benchmarks.md's catch-up-outlier figures."""
import ast
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import catchup_outlier  # noqa: E402


def test_a_row_per_spike_with_every_rounds_steps_and_the_fitted_line(capsys):
    assert catchup_outlier.main(["--spikes", "0,1", "--rounds", "2", "--tokens", "64"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if re.match(r"\| [\d.]+ \|", r)]
    assert len(rows) == 2 and all(r.count("{") == 2 and "ms/token" in r for r in rows)
    for row in rows:                                       # no spike, and a 1 s one-off: round 2 drafts either way
        round2 = ast.literal_eval(row.split("|")[3].strip())
        assert sum(n for g, n in round2.items() if g > 0) > 10 * round2.get(0, 0), row
