"""Compile every kernel for sm_90 (H100/H200) on a machine without a GPU.

Run as a script with TRITON_INTERPRET=0 (see test_compile.py). The interpreter runs kernel
bodies as numpy and so misses codegen errors (loop-carried types, dot shapes, early returns);
this goes through the real front end, the NVIDIA passes and the bundled ptxas.
"""
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nightjar.triton_kernels.block_migration import _migrate_kernel  # noqa: E402
from nightjar.triton_kernels.kv_store import _kv_store_kernel  # noqa: E402
from nightjar.triton_kernels.paged_attention import _paged_attention_kernel  # noqa: E402
from nightjar.triton_kernels.rejection_triton import _accept, _candidates  # noqa: E402


def build(fn, ptrs, consts, floats=(), ints64=()):
    """Signature: pointers as given, constexprs, the rest i32 (or fp32 / i64 where named)."""
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptrs:
            sig[name] = ptrs[name]
        else:
            sig[name] = "fp32" if name in floats else "i64" if name in ints64 else "i32"
    t = time.perf_counter()
    triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32))
    print(f"ok {fn.__name__} {consts} {time.perf_counter() - t:.1f}s")


def main() -> None:
    attn = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16", bt_ptr="*i32",
                qsl_ptr="*i32", seq_lens_ptr="*i32")
    # decode/verify tiles (G=4); prefill tiles with non-power-of-2 G and d; B == 1 specialised
    build(_paged_attention_kernel, attn, dict(HEAD_DIM=128, BLOCK_SIZE=16, G=4, BLOCK_Q=4, BLOCK_M=16,
          BLOCK_N=64, BLOCK_D=128, UPCAST=False), floats=("scale",))
    build(_paged_attention_kernel, {**attn, "bt_ptr": "*i64", "qsl_ptr": "*i64"},
          dict(HEAD_DIM=96, BLOCK_SIZE=16, G=3, BLOCK_Q=16, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128,
               UPCAST=False, num_seqs=1), floats=("scale",))
    build(_kv_store_kernel, dict(k_ptr="*i16", v_ptr="*i16", kc_ptr="*i16", vc_ptr="*i16", slot_ptr="*i64"),
          dict(HEAD_DIM=128, NUM_KV=8, BLOCK_SIZE=16, BLOCK_T=4, BLOCK_E=1024))
    build(_migrate_kernel, dict(data_ptr="*i16", pairs_ptr="*i64"), dict(BLOCK=8192, NUM_CHUNKS=2),
          ints64=("stride_lk", "stride_b"))
    for has_q in (True, False):
        build(_candidates, dict(p_ptr="*fp32", q_ptr="*fp32", e_ptr="*fp32", nd_ptr="*i64",
                                greedy_ptr="*u8", cand_ptr="*i64"), dict(HAS_Q=has_q, BLOCK_V=1024))
        build(_accept, dict(p_ptr="*fp32", q_ptr="*fp32", d_ptr="*i64", u_ptr="*fp32", nd_ptr="*i64",
                            greedy_ptr="*u8", cand_ptr="*i64", out_ptr="*i64", acc_ptr="*i64"),
              dict(HAS_Q=has_q, BLOCK_G=16))


if __name__ == "__main__":
    sys.exit(main())
