#!/usr/bin/env bash
# Closed-loop throughput of several servers side by side, finely interleaved: every variant's server is started
# once and kept up, then R rounds run a D-second closed loop of N clients against each in turn (order rotated per
# round). Drift of this noisy box (±10 % over minutes) then hits every variant alike, and each round gives one
# paired ratio. A server that is not in its block is idle.
#   bash bench/round_robin.sh OUT N D R "NAME|DIR|POLICY[|FLAGS];NAME|DIR|POLICY[|FLAGS];..."
# DIR is a checkout to serve from (the worktree of a revision, or .); SERVER_ARGS overrides the server flags that
# every variant gets, FLAGS (optional) adds server flags to one variant (e.g. "--draft-tree 1").
# Prints one line per block and, at the end, each variant's per-round ratio to the first variant.
set -uo pipefail
if [ $# -ne 5 ]; then
  echo "usage: bash bench/round_robin.sh OUT N D R 'NAME|DIR|POLICY[|FLAGS];...'" >&2; exit 2
fi
OUT=$1; N=$2; D=$3; R=$4; IFS=';' read -r -a V <<< "$5"
cd "$(dirname "$0")/.."
ROOT=$(pwd); PY=$ROOT/.venv/bin/python
ARGS=${SERVER_ARGS:---device-memory 575000000 --max-num-seqs 64 --dtype bfloat16 --planner-profile auto}
PORT0=${PORT0:-18100}
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)   # absolute: the servers start from their own DIR
stop() { for i in "${!V[@]}"; do pkill -f -- "--port $((PORT0 + i)) " 2>/dev/null; done; }
trap stop EXIT
for i in "${!V[@]}"; do
  port=$((PORT0 + i))
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then echo "port $port is taken" >&2; exit 2; fi
  IFS='|' read -r name dir pol flags <<< "${V[$i]}"
  (cd "$dir" && "$PY" -m nightjar serve --policy "$pol" --host 127.0.0.1 --port "$port" $ARGS $flags \
     > "$OUT/server_$name.log" 2>&1 &)
done
for i in "${!V[@]}"; do
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$((PORT0 + i))/health" >/dev/null && break; sleep 1; done
done
n=${#V[@]}
for ((r = 0; r < R; r++)); do
  for ((j = 0; j < n; j++)); do
    i=$(( (j + r) % n )); IFS='|' read -r name _ <<< "${V[$i]}"
    "$PY" -m nightjar bench serve --base-url "http://127.0.0.1:$((PORT0 + i))" --closed-loop "$N" --duration "$D" \
      --dataset-name prompts --split heldout --output-len 96 --temperature 0 --disable-tqdm --quiet --seed "$r" \
      --output-json "$OUT/${name}_r$r.json" >/dev/null 2>>"$OUT/client.log"
    echo "round $((r + 1)) $name $("$PY" -c "import json; print(round(json.load(open('$OUT/${name}_r$r.json'))['output_throughput'], 1))")"
  done
done
"$PY" - "$OUT" "${V[@]}" <<'PYEOF'
import json, os, statistics, sys
out, names = sys.argv[1], [v.split("|")[0] for v in sys.argv[2:]]
tps = {n: [] for n in names}
r = 0
while all(os.path.exists(f"{out}/{n}_r{r}.json") for n in names):
    for n in names:
        tps[n].append(json.load(open(f"{out}/{n}_r{r}.json"))["output_throughput"])
    r += 1
for n in names:
    ratios = [a / b for a, b in zip(tps[n], tps[names[0]])]
    print(f"{n}: median {statistics.median(tps[n]):.1f} tok/s; / {names[0]} per round "
          f"{' '.join(f'{x:.3f}' for x in ratios)} (median {statistics.median(ratios):.3f})")
PYEOF
