"""argparse value types shared by the command lines (``nightjar``, ``nightjar bench``, ``nightjar trace``)."""
from __future__ import annotations

import argparse


def positive(kind):
    """An argparse ``type`` for a number of ``kind`` (int, float) > 0; anything else is a one-line usage error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
        return value
    parse.__name__ = kind.__name__
    return parse


def positive_list(kind):
    """An argparse ``type`` for comma-separated numbers of ``kind``, each > 0 (``1,4,16``), as a tuple."""
    one = positive(kind)

    def parse(text: str):
        return tuple(one(v) for v in text.split(","))
    parse.__name__ = f"{kind.__name__} list"
    return parse
