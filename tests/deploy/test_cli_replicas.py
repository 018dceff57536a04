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
    (["--replicas", "2", "--max-connections", "8", "--body-timeout", "5"], "--body-timeout, --max-connections: not"),
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


def test_replica_flags_map_to_serve_options_serve_accepts():
    pytest.importorskip("ray")
    from ray import serve

    from nightjar.deploy.cluster import ClusterOptions
    from nightjar.deploy.serve_app import EngineReplica

    fixed = ClusterOptions(num_replicas=3, replica_cpus=2, replica_gpus=0.5, max_ongoing_requests=32)
    assert fixed.replica_config() == {"num_replicas": 3, "max_ongoing_requests": 32,
                                      "ray_actor_options": {"num_cpus": 2, "num_gpus": 0.5}}
    auto = ClusterOptions(min_replicas=0, max_replicas=4, target_ongoing_requests=8)
    cfg = auto.replica_config()
    assert cfg["autoscaling_config"] == {"min_replicas": 0, "max_replicas": 4, "initial_replicas": 1,
                                         "target_ongoing_requests": 8}
    for c in (fixed, auto):               # Serve validates its options when the deployment is declared
        d = serve.deployment(EngineReplica, name="NightjarEngine", **c.replica_config())
        assert d.max_ongoing_requests == c.max_ongoing_requests
