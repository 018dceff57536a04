"""Importing nightjar sets libgomp's spin count for torch's OpenMP workers (nightjar/__init__.py), unless the user
set one or torch was loaded first (libgomp reads it once, when torch loads it)."""
import os
import subprocess
import sys

import nightjar

PROBE = "import os, {first}; print(os.environ.get('GOMP_SPINCOUNT'))"


def _probe(first: str, value: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if value is not None:
        env["GOMP_SPINCOUNT"] = value
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_nightjar_sets_the_spin_count_before_torch_loads():
    assert _probe("nightjar, torch") == nightjar.GOMP_SPINCOUNT == "10000"


def test_a_users_spin_count_is_kept():
    assert _probe("nightjar, torch", "77") == "77"


def test_nothing_is_set_once_torch_is_loaded():
    assert _probe("torch, nightjar") == "None"
