"""The shared argparse value types (nightjar/argtypes.py)."""
from __future__ import annotations

import argparse

import pytest

from nightjar.argtypes import positive, positive_list


def test_positive_takes_numbers_above_zero_and_names_what_is_wrong():
    assert positive(int)("3") == 3 and positive(float)("0.5") == 0.5
    for text, why in (("x", "not a number"), ("0", "must be > 0"), ("-2", "must be > 0")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            positive(int)(text)


def test_positive_list_reads_comma_separated_counts_or_exits_with_one_usage_line(capsys):
    assert positive_list(int)("1,4,16") == (1, 4, 16)
    ap = argparse.ArgumentParser(prog="tool")
    ap.add_argument("--rows", type=positive_list(int))
    for bad, why in (("1,x", "not a number: 'x'"), ("4,0", "must be > 0: '0'")):
        with pytest.raises(SystemExit) as e:
            ap.parse_args(["--rows", bad])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1] == f"tool: error: argument --rows: {why}"
