"""bench compare entries POLICY@FLAGS: one entry runs its server with extra flags (e.g. a quantization)."""
from __future__ import annotations

import argparse

import pytest

from nightjar.bench.cli import _server_context
from nightjar.bench.compare import parse_policies, split_variant


def test_an_entry_splits_into_its_policy_and_its_own_server_flags():
    assert split_variant("nightjar") == ("nightjar", "")
    assert split_variant("fixed:2@--quantization int4") == ("fixed:2", "--quantization int4")
    assert parse_policies("nightjar,nightjar@--quantization int8") == ["nightjar", "nightjar@--quantization int8"]
    with pytest.raises(ValueError, match="names no policy"):
        parse_policies("@--quantization int4")


def test_a_launched_server_gets_the_shared_and_the_entry_flags():
    a = argparse.Namespace(in_process=False, server_args="--dtype bfloat16", server_model=None, startup_timeout=5)
    cmd = _server_context(a, "fixed:2@--quantization int4").command
    assert cmd[cmd.index("--policy") + 1] == "fixed:2"
    assert cmd[-4:] == ["--dtype", "bfloat16", "--quantization", "int4"]
