"""``nightjar simulate --replicas N``: replicas of the real control-plane actors on one virtual clock."""
from __future__ import annotations

import pytest

from nightjar.actors.step_profile import roofline_profile
from nightjar.cli import main as cli_main
from nightjar.offline.sim.cluster import ClusterSimulation, Router, run_cluster
from nightjar.offline.sim.workload import make_workload
from nightjar.offline.simulate import SimConfig, simulate


@pytest.fixture(scope="module")
def profile():
    return roofline_profile("a100", "13b", block_size=16, max_b=256)


def workload(rate: float, n: int, output_mean: float = 64):
    return make_workload(f"poisson:{rate}", seed=0, num_requests=n, duration_s=None, phase_s=30.0,
                         prompt_mean=128, output_mean=output_mean, sigma=0.6, max_len=2048)


def test_one_replica_reproduces_the_plain_simulation_exactly(profile):
    wl, cfg = workload(6, 150), SimConfig()
    plain = simulate(profile, wl, "nightjar", cfg)
    one = ClusterSimulation(profile, wl, "nightjar", 1, "p2c", cfg).run()
    r = one.replicas[0]
    for k in ("finished", "sim_time_s", "out_tokens", "mean_ttft_s", "mean_e2e_s", "mean_gamma", "mean_batch",
              "steps", "offloads", "reloads", "acceptance"):
        assert getattr(r, k) == getattr(plain, k), k
    assert (one.out_tokens, one.finished, one.sim_time_s) == (plain.out_tokens, plain.finished, plain.sim_time_s)


@pytest.mark.parametrize("router", ["round-robin", "least-ongoing", "p2c"])
def test_every_request_is_served_once_by_some_replica(profile, router):
    wl = workload(18, 240)
    res = ClusterSimulation(profile, wl, "nightjar", 3, router, SimConfig()).run()
    assert res.finished == len(wl) == sum(r.num_requests for r in res.replicas)
    assert sum(r.finished for r in res.replicas) == len(wl)
    assert res.out_tokens == sum(int(x) for x in wl.output_lens)
    assert all(r.num_requests > 0 and r.steps > 0 for r in res.replicas)
    if router == "round-robin":
        assert {r.num_requests for r in res.replicas} == {80}


def test_three_replicas_carry_a_load_that_swamps_one(profile):
    wl = workload(20, 240, output_mean=128)       # ~2.5x what one simulated A100 can decode
    one = simulate(profile, wl, "nightjar", SimConfig())
    three = ClusterSimulation(profile, wl, "nightjar", 3, "least-ongoing", SimConfig()).run()
    assert three.mean_e2e_s < one.mean_e2e_s / 2 and three.sim_time_s < one.sim_time_s


def test_routers_pick_by_ongoing_requests():
    lo = Router("least-ongoing", 3)
    lo.ongoing = [4, 1, 2]
    assert lo.pick() == 1 and lo.ongoing == [4, 2, 2]
    assert lo.pick() == 2                      # tie 2/2: the next one in round-robin order after 1
    p2c = Router("p2c", 2, seed=3)
    p2c.ongoing = [5, 0]
    assert all(p2c.pick() == 1 for _ in range(5))      # with two replicas both are always drawn
    rr = Router("round-robin", 3)
    assert [rr.pick() for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_the_command_line_prints_the_cluster_and_its_replicas(capsys):
    rc = cli_main(["simulate", "--gpu", "a100", "--workload", "poisson:10", "--num-requests", "60",
                   "--output-len", "32", "--policies", "nightjar", "--replicas", "2", "--router", "p2c",
                   "--per-replica"])
    out = capsys.readouterr().out
    assert rc == 0 and "p2c" in out and "replica 0" in out and "replica 1" in out


@pytest.mark.parametrize("argv,needle", [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--router", "p2c"], "need --replicas"),
    (["--replicas", "2", "--trace-out", "x.njtrace"], "--trace-out"),
    (["--replicas", "2", "--router", "p2c", "--jobs", "2"], "--jobs > 1 needs --router round-robin"),
])
def test_cluster_flag_mistakes_exit_2_with_one_line(capsys, argv, needle):
    assert cli_main(["simulate", "--gpu", "a100", *argv]) == 2
    assert needle in capsys.readouterr().err


def test_closed_loop_clients_spread_over_the_replicas(profile):
    wl = workload(1, 120)
    res = ClusterSimulation(profile, wl, "nightjar", 2, "least-ongoing", SimConfig(closed_loop=8)).run()
    assert res.finished == 120 and all(r.num_requests >= 50 for r in res.replicas)
    assert max(r.mean_batch for r in res.replicas) <= 8


def test_round_robin_over_processes_gives_the_serial_results_exactly(profile):
    wl = workload(14, 200)
    serial = run_cluster(profile, wl, "nightjar", 3, "round-robin", SimConfig(), jobs=1)
    split = run_cluster(profile, wl, "nightjar", 3, "round-robin", SimConfig(), jobs=2)
    for k in ("finished", "out_tokens", "sim_time_s", "mean_ttft_s", "mean_e2e_s", "p99_ttft_s"):
        assert getattr(split, k) == getattr(serial, k), k
    for a, b in zip(serial.replicas, split.replicas, strict=True):
        for k in ("num_requests", "finished", "out_tokens", "mean_ttft_s", "mean_gamma", "mean_batch", "steps",
                  "offloads", "acceptance"):
            assert getattr(a, k) == getattr(b, k), k
