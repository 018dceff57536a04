"""`nightjar serve --replicas N` mistakes exit 2 with one line, before any model loads or Ray starts."""
from __future__ import annotations

import pytest

from nightjar.cli import main


@pytest.mark.parametrize("argv,needle", [
    (["--replicas", "0"], "--replicas: must be > 0"),
    (["--min-replicas", "3", "--max-replicas", "1"], "--min-replicas <= --max-replicas"),
    (["--min-replicas", "1"], "go together"),
    (["--replicas", "2", "--replica-cpus", "-1"], "--replica-cpus"),
    (["--replicas", "2", "--trace", "t.jsonl"], "--trace"),
    (["--replicas", "2", "--ray-address", "nonsense"], "--ray-address"),
    (["--replicas", "2", "--ray-address", "127.0.0.1:1"], "cannot reach the Ray cluster at 127.0.0.1:1"),
])
def test_replica_flag_mistakes_exit_2_with_one_line(capsys, argv, needle):
    pytest.importorskip("ray")
    try:
        rc = main(["serve", *argv])
    except SystemExit as e:        # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and needle in err[-1] and "Traceback" not in "\n".join(err), err
