#!/usr/bin/env bash
# The planner/elastic-memory benchmark (issue "Nightjar's core"): real SmolLM2 target + the default drafter,
# bf16, a device budget where the draft is worth >= 15 % of the KV pool. Policies are compared on the
# same arrivals, each on a fresh server, order rotated across repetitions (nightjar bench compare).
#   bash bench/policies.sh [OUT_DIR]            (REPEATS, DURATION, LEVELS, POLICIES, PROFILE override; TRACE=0 skips
#                                                the phased trace)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/policies}
mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
# 575 MB: with the default draft (the head) resident the target's KV pool holds 525 blocks, 676 without it
# (`max KV blocks` of bench compare, 2026-12-02)
MEM=${MEM:-575000000}
# The planner reads this machine's measured step-time profile (--planner-profile auto: measured once,
# about 35 s, then cached); PROFILE=none runs it on the generic prior instead.
PROFILE=${PROFILE:-auto}
PROF_ARG=$([ "$PROFILE" = none ] || echo "--planner-profile $PROFILE")
SERVER="--device-memory $MEM --max-num-seqs 64 --dtype bfloat16 $PROF_ARG"
[ "$PROFILE" = auto ] && "$PY" -m nightjar generate hi --max-tokens 1 --dtype bfloat16 --planner-profile auto >/dev/null
POLICIES=${POLICIES:-off,fixed:1,fixed:2,fixed:3,fixed:4,dsd,banditspec,nightjar-paper,nightjar,nightjar-nooffload}
REPEATS=${REPEATS:-1}
TRACE_SCALE=${TRACE_SCALE:-0.6}
DURATION=${DURATION:-20}
for N in ${LEVELS:-1 4 16 64}; do
  "$PY" -m nightjar bench compare --policies "$POLICIES" --closed-loop "$N" --duration "$DURATION" \
    --repeats "$REPEATS" --server-args "$SERVER" --dataset-name prompts --split heldout --output-len 96 \
    --temperature 0 --output-json "$OUT/closed_$N.json" --disable-tqdm | tee "$OUT/closed_$N.md"
done
[ "${TRACE:-1}" = 0 ] && exit 0
"$PY" -m nightjar bench compare --policies "${TRACE_POLICIES:-off,fixed:2,fixed:4,nightjar,nightjar-nooffload}" \
  --trace bench/traces/phased_low_surge_low.json --trace-time-scale "$TRACE_SCALE" --repeats "$REPEATS" --server-args "$SERVER" \
  --dataset-name prompts --split all --temperature 0 --output-json "$OUT/phased.json" \
  --plot "$OUT/phased.png" --disable-tqdm | tee "$OUT/phased.md"
