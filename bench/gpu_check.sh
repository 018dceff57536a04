#!/usr/bin/env bash
# GPU check for the Triton kernels (<= ~8 min on an H200; also runs, refs only, on a CPU box).
#   1. kernel tests on CUDA (compiled Triton, no interpreter; gpu-marked tests included, among them
#      tests/triton_kernels/test_cuda_graph.py: captured CUDA graphs replay the eager logits)
#   2. bench/kernel_bench.py: each kernel vs its torch ref and vs the copy-bandwidth roofline
#   3. bench/cuda_graph_bench.py: eager vs CUDA-graph step time on the 7B-shaped random target
#      (CPU: a no-capture smoke run, no timing claim)
#   4. python -m nightjar.bench.e2e_synthetic --detail (the planner reads a quick profile measured first, as
#      `serve` reads its cached one; per run: γ histogram, offloads, the planner's snapshot)
# Every section runs under its own timeout; the script keeps going after a failed section and
# exits non-zero at the end if any failed. Env: PYTHON (interpreter); section limits in seconds: TEST_TIMEOUT,
# BENCH_TIMEOUT, GRAPH_TIMEOUT, E2E_TIMEOUT.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

PY=""
for cand in "${PYTHON:-}" .venv/bin/python python3 python; do
    if [[ -n "$cand" ]] && command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch" 2>/dev/null; then
        PY="$cand"
        break
    fi
done
if [[ -z "$PY" ]]; then
    echo "no python with torch found (set PYTHON=...)" >&2
    exit 2
fi

FAILED=()
section() { printf '\n==================== %s ====================\n' "$1"; }
run() {  # run NAME TIMEOUT CMD...
    local name="$1" limit="$2" rc=0 t0=$SECONDS
    shift 2
    timeout --signal=INT --kill-after=10 "$limit" "$@" || rc=$?
    echo "---- $name: rc=$rc, $((SECONDS - t0)) s"
    if [[ $rc -ne 0 ]]; then FAILED+=("$name (rc=$rc)"); fi
}

section "environment"
"$PY" - <<'EOF'
import torch
print("python", __import__("sys").version.split()[0], "| torch", torch.__version__)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"cuda {torch.version.cuda} | {p.name} | {p.total_memory / 2**30:.0f} GiB | sm_{p.major}{p.minor}")
else:
    print("no CUDA: tests run under TRITON_INTERPRET=1, the bench times torch refs only")
EOF
HAS_CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")
if [[ "$HAS_CUDA" == 1 ]]; then
    unset TRITON_INTERPRET          # compiled kernels, not the interpreter
    DEVICE=cuda
else
    DEVICE=cpu
fi

section "kernel tests ($DEVICE)"
run "kernel tests" "${TEST_TIMEOUT:-300}" "$PY" -m pytest tests/triton_kernels -q -p no:cacheprovider -rs --durations=8

section "kernel bench ($DEVICE)"
run "kernel bench" "${BENCH_TIMEOUT:-150}" "$PY" bench/kernel_bench.py --device "$DEVICE"

section "cuda graphs: eager vs graph step time ($DEVICE)"
if [[ "$HAS_CUDA" == 1 ]]; then
    run "cuda graph bench" "${GRAPH_TIMEOUT:-240}" "$PY" bench/cuda_graph_bench.py --batches 1,8,24,64 --q 1,4
else
    run "cuda graph bench (smoke)" 120 "$PY" bench/cuda_graph_bench.py --smoke
fi

section "e2e synthetic"
if "$PY" -c "import importlib.util as u, sys; sys.exit(0 if u.find_spec('nightjar.bench') and u.find_spec('nightjar.bench.e2e_synthetic') else 1)" 2>/dev/null; then
    run "e2e synthetic" "${E2E_TIMEOUT:-300}" "$PY" -m nightjar.bench.e2e_synthetic --detail
else
    echo "nightjar.bench.e2e_synthetic not found: skipped"
fi

section "summary"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    printf 'FAILED: %s\n' "${FAILED[@]}"
    exit 1
fi
echo "all sections passed"
