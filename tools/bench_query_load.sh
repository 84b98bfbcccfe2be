#!/usr/bin/env bash
# How much do shardctl queries slow a training job? Runs the 2-rank mlp job
# alternately without and with `shardctl load` (status/layout/memory at
# --rate queries/s, default 50), ROUNDS times each, and compares the
# trainers' reported time for the same steps.
#   tools/bench_query_load.sh [ROUNDS] [STEPS] [RATE]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}; steps=${2:-20}; rate=${3:-50}
bazel build -c opt //tools:shardrun //tools:shardopt_train //tools:shardctl 2>&1 | tail -n 1
B=bazel-bin/tools
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() {  # run WITH_LOAD -> prints seconds for the steps
  rm -f "$tmp/addr"
  $B/shardrun --nproc 2 --port-file "$tmp/addr" -- $B/shardopt_train --model=mlp --steps=$steps \
    >"$tmp/log" 2>&1 &
  local pid=$!
  if [[ $1 == 1 ]]; then
    for _ in $(seq 1 300); do [[ -s "$tmp/addr" ]] && break; sleep 0.1; done
    $B/shardctl --coordinator="$(cat "$tmp/addr")" status --wait=120 >/dev/null
    $B/shardctl --coordinator="$(cat "$tmp/addr")" load --rate=$rate --duration=600 \
      >"$tmp/load" 2>&1 &
    local load=$!
  fi
  wait $pid
  if [[ $1 == 1 ]]; then
    wait $load 2>/dev/null || true  # stops by itself once the job is gone
    sed 's/^/  shardctl load: /' "$tmp/load" >&2
  fi
  sed -n 's/.*done: [0-9]* steps in \([0-9.]*\) s.*/\1/p' "$tmp/log"
}
base=(); loaded=()
for r in $(seq 1 "$rounds"); do
  base+=("$(run 0)"); loaded+=("$(run 1)")
  echo "round $r: without queries ${base[-1]} s, with $rate queries/s ${loaded[-1]} s"
done
python3 - "${base[*]}" "${loaded[*]}" "$rate" <<'PY'
import statistics, sys
b = [float(x) for x in sys.argv[1].split()]
l = [float(x) for x in sys.argv[2].split()]
mb, ml = statistics.median(b), statistics.median(l)
print(f"median: without {mb:.2f} s, with {sys.argv[3]} queries/s {ml:.2f} s: slowdown {100 * (ml / mb - 1):+.1f}%")
PY
