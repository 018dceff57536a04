"""Import before ``triton`` in every kernel module: without CUDA, select the Triton interpreter.

Compiled Triton cannot launch without a GPU ("0 active drivers"), so on a CPU-only machine the
interpreter is the only way the kernels run (tests, CPU tensors). TRITON_INTERPRET is read when
a function is decorated, triton's own ``tl.zeros``/``tl.max`` included, so it has to be set before
the first ``import triton`` in the process. An explicit TRITON_INTERPRET=0 is respected.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
