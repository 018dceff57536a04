"""Engine configuration: one frozen Struct (recorded in trace headers)."""
from __future__ import annotations

import msgspec


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    model: str = "smollm2-135m"
    draft: str | None = "default"
    policy: str = "nightjar"
    gamma_max: int = 4
    dtype: str = "bfloat16"
    quantization: str = "none"             # none; weight-only int8, int4; w4a8 (int4, int8 activations) (CPU)
    draft_quantization: str | None = None  # the draft's; None: as ``quantization``, "mixed" beside "none"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None          # explicit pool size (overrides the memory budget)
    device_memory: float | None = None     # bytes (>1) or a fraction of the device/host memory (<=1)
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_queue: int = 256                   # admitted-but-unfinished requests before 429s
    seed: int = 0
    elastic_memory: bool | None = None     # None: as the policy says
    low_free_frac: float = 0.10            # τ_low as a fraction of the pool
    persist_steps: int = 3                 # T_persist
    offload_on_queue: bool = True          # SD off and a request waiting also offloads (False: τ_low alone)
    draft_kv_tokens: int | None = None     # draft KV capacity in tokens (default: target pool's)
    synthetic_acceptance: float | None = None   # TESTING ONLY: accept each draft with this probability
    enforce_eager: bool = False            # CUDA: no CUDA graphs (models/cuda_graph.py); CPU is always eager
    inline_compute: bool = False           # forwards on the event loop's own thread (no thread hand-offs; the loop
                                           # serves no I/O while one runs): for one client, not a server
    run_ahead: bool = True                 # with a compute thread: start the next γ = 0 decode step before this
                                           # one commits (actors/verifier.py)
    draft_tree: int = 0                    # greedy rows of a draft head also send this many runner-up first drafts
                                           # (siblings of d1), verified beside the chain (actors/verifier.py)
    draft_tree_batch: int = 2              # the largest decode batch whose rows send siblings
    prompt_lookup: int = 2                 # a draft head's rows whose last N+ tokens (N..3) occurred earlier in the
                                           # request draft what followed them instead (actors/draft_head.py; 0: off)
    planner_profile: str | None = None     # a `nightjar profile` JSON for the planner's step times, "auto" (this
                                           # machine's cached one, measured on first use) or None (the prior)
    trace: str | None = None               # record every bus envelope to this file
    trace_max_bytes: int = 1 << 30         # rotate the trace file past this size
