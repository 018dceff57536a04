#!/usr/bin/env bash
# Closed-loop throughput of a git revision's server against the working tree's, same load, interleaved:
#   bash bench/before_after.sh REV "N1 N2" "VARIANT;VARIANT..." [OUT_DIR]
# A VARIANT is "where|policy|server flags": where = before (REV, checked out in a temporary worktree) or
# after (this tree). Example (issue #18's closed-loop table):
#   bash bench/before_after.sh 60ea72b "16 64" \
#     "before|nightjar|;after|nightjar|;after|nightjar|--quantization int8;after|nightjar|--quantization int4"
# REPEATS (default 2) rounds run the variants in rotated order; DURATION (default 30) s per run.
set -euo pipefail
cd "$(dirname "$0")/.."
REV=$1; LEVELS=$2; IFS=';' read -r -a VARIANTS <<< "$3"; OUT=${4:-out/before_after}
PY=$(pwd)/.venv/bin/python
REPEATS=${REPEATS:-2}; DURATION=${DURATION:-30}
BASE="--device-memory ${MEM:-575000000} --max-num-seqs 64 --dtype bfloat16"
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
WT=$(mktemp -d /tmp/nightjar-before-XXXX)
git worktree add -q --detach "$WT" "$REV"
trap 'git worktree remove --force "$WT"' EXIT
for N in $LEVELS; do
  for ((r = 0; r < REPEATS; r++)); do
    n=${#VARIANTS[@]}
    for ((i = 0; i < n; i++)); do
      v=${VARIANTS[$(( (i + r) % n ))]}
      IFS='|' read -r where policy flags <<< "$v"
      dir=$(pwd); [ "$where" = before ] && dir=$WT
      tag=$(echo "${where}_${policy}_${flags}" | tr -c 'A-Za-z0-9_.\n-' '_')
      echo "[before_after] N=$N rep $((r + 1)) $where $policy $flags" >&2
      (cd "$dir" && "$PY" -m nightjar bench serve --launch --policy "$policy" --server-args "$BASE $flags" \
        --closed-loop "$N" --duration "$DURATION" --dataset-name prompts --split heldout --output-len 96 \
        --temperature 0 --disable-tqdm --quiet --output-json "$OUT/N${N}_${tag}_rep$((r + 1)).json") \
        || echo "[before_after]   failed" >&2
    done
  done
done
"$PY" - "$OUT" <<'PYEOF'
import glob, json, os, re, statistics, sys
from collections import defaultdict
rows = defaultdict(list)
for f in glob.glob(os.path.join(sys.argv[1], "N*_rep*.json")):
    m = re.match(r"N(\d+)_(.*)_rep\d+\.json", os.path.basename(f))
    r = json.load(open(f))
    rows[(int(m[1]), m[2])].append((r["output_throughput"], r["mean_e2el_ms"]))
print("| N | variant | runs | output tok/s (median) | mean E2E ms (median) |")
print("|---:|---|---:|---:|---:|")
for (n, tag), xs in sorted(rows.items()):
    print(f"| {n} | {tag} | {len(xs)} | {statistics.median(x[0] for x in xs):.1f} | "
          f"{statistics.median(x[1] for x in xs):.0f} |")
PYEOF
