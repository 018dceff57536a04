#!/usr/bin/env bash
# Every figure of docs/benchmarks.md's "published results", in one run (2-core CPU: about an hour).
#   bash bench/publish.sh [OUT_DIR]
# Overrides: REPEATS (phased trace, default 3), RATES, RATE_PROMPTS, RATE_POLICIES, TRACE_POLICIES,
# TRACE_SCALE, SAT_CONCURRENCY, SAT_DURATION, SKIP (space-separated stage names to skip:
# single rates phased saturation peers simval).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/publish}
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
SKIP=${SKIP:-}
# 575 MB: target 269 MB + draft 31 MB weights + ~700 blocks of KV (the draft is ~19 % of the pool)
SERVER="--device-memory ${MEM:-575000000} --max-num-seqs 64 --dtype bfloat16"
COMMON="--server-args \"$SERVER\" --dataset-name prompts --split heldout --temperature 0 --disable-tqdm"
skip() { [[ " $SKIP " == *" $1 "* ]]; }
compare() { eval "$PY" -m nightjar bench compare "$COMMON" "$@"; }
echo "# machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(date -u +%F)" | tee "$OUT/machine.txt"

# 1. single stream: held-out acceptance, off vs fixed:γ at B=1
skip single || "$PY" bench/acceptance.py --prompts heldout --gamma 4 --max-tokens 64 | tee "$OUT/single.txt"
BEST=$(tail -1 "$OUT/single.txt" 2>/dev/null | "$PY" -c 'import json,sys; print(json.loads(sys.stdin.read())["best_gamma"])' 2>/dev/null || echo 2)
echo "best fixed gamma at B=1: $BEST"

# 2. static Poisson rates (the CPU saturates near 1 req/s: the upper rates measure overload)
if ! skip rates; then
  for R in ${RATES:-0.5 1 2 4 8 16}; do
    compare --policies "${RATE_POLICIES:-off,fixed:$BEST,nightjar}" --request-rate "$R" \
      --num-prompts "${RATE_PROMPTS:-24}" --output-len 96 --repeats 1 --output-json "$OUT/rate_$R.json" \
      | tee "$OUT/rate_$R.md"
  done
fi

# 3. the phased trace (low -> surge -> low), every policy, REPEATS interleaved repetitions
skip phased || compare --policies "${TRACE_POLICIES:-off,fixed:$BEST,fixed:4,dsd,nightjar,nightjar-nooffload}" \
  --trace bench/traces/phased_low_surge_low.json --trace-time-scale "${TRACE_SCALE:-0.5}" \
  --repeats "${REPEATS:-3}" --output-json "$OUT/phased.json" --plot "$OUT/phased.png" | tee "$OUT/phased.md"

# 4. saturation: does offloading the draft buy batch size and throughput?
skip saturation || compare --policies off,nightjar-nooffload,nightjar --closed-loop "${SAT_CONCURRENCY:-64}" \
  --duration "${SAT_DURATION:-30}" --output-len 96 --repeats 1 --output-json "$OUT/saturation.json" \
  | tee "$OUT/saturation.md"

# 5. peers on the same machine (llama.cpp only if llama-cpp-python is installed)
skip peers || "$PY" bench/peers.py --num-prompts 16 --output-len 64 --policies "off,fixed:$BEST,nightjar" \
  --output-json "$OUT/peers.json" | tee "$OUT/peers.md"

# 6. simulator vs this machine: a measured profile, then real vs simulated on a short phased workload
if ! skip simval; then
  "$PY" -m nightjar profile --quick --out "$OUT/profile.json" | tail -3
  for P in ${SIM_POLICIES:-off fixed:$BEST nightjar}; do
    "$PY" -m nightjar.offline.sim.validate --profile "$OUT/profile.json" --policy "$P" --phases '[[10, 0.5], [10, 2.0]]' \
      | tee "$OUT/simval_${P/:/_}.txt"
  done
fi
