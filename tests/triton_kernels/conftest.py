"""Run the Triton kernels under the interpreter (CPU tensors) when there is no CUDA.

TRITON_INTERPRET is read when a function is decorated (triton's own tl.zeros etc. at
``import triton``), so it must be set before triton is first imported in the process. The
kernel package sets it itself (nightjar/triton_kernels/__init__.py); this is the same guard for
runs that import triton some other way first.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pathlib  # noqa: E402

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_HERE = pathlib.Path(__file__).parent


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture(autouse=True)
def _interpreter_is_active():
    if DEVICE == "cpu":
        import triton.language as tl
        if type(tl.zeros).__name__ != "InterpretedFunction":
            pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (by torch.compile or "
                        "another module); run tests/triton_kernels on its own or export "
                        "TRITON_INTERPRET=1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and _HERE in pathlib.Path(item.path).parents:
            item.add_marker(skip)
