"""bench/peers.py: backends run one at a time, each in a process of its own, order rotated per round."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
peers = pytest.importorskip("peers")


def test_a_backend_runs_in_a_process_of_its_own():
    assert peers.in_own_process(os.getpid, ()) != os.getpid()


def test_rounds_rotate_the_order_and_keep_one_row_per_backend():
    seen = []

    def runner(name):
        seen.append(name)
        return {"status": "ok", "single_tok_s": 1.0}

    def fails():
        seen.append("c")
        raise RuntimeError("boom")

    runners = [("a", runner, ("a",)), ("b", runner, ("b",)), ("c", fails, ())]
    rows = peers.run_rounds(runners, 2, run=lambda fn, args: fn(*args))
    assert seen == ["a", "b", "c", "c", "a", "b"]
    assert [len(r) for r in rows.values()] == [2, 2, 2]
    assert rows["c"][0]["status"] == "failed: RuntimeError: boom"
    assert rows["a"][1] == {"status": "ok", "single_tok_s": 1.0}


def test_every_runner_and_its_arguments_can_be_sent_to_another_process():
    import argparse
    import pickle

    a = argparse.Namespace(backends="transformers,llama.cpp,nightjar", policies="off,fixed:1@--quantization int4",
                           server_args="--dtype bfloat16", output_len=8, concurrency=0, ignore_eos=False, threads=2)
    runners = peers.backend_runners(a, ["hi"])
    assert [n for n, _, _ in runners] == ["transformers", "llama.cpp", "nightjar off",
                                          "nightjar fixed:1@--quantization int4"]
    for _, fn, args in runners:
        pickle.dumps((fn, args))
    assert runners[-1][2][-2:] == ("fixed:1", "--dtype bfloat16 --quantization int4")
