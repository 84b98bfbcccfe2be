#!/usr/bin/env bash
# Live resize against checkpoint-and-resume (docs/elastic.md): how long a
# running job pauses to go from 2 to 3 ranks and back, and how many bytes move
# between ranks against the least possible (the slices that change owner),
# next to a save of the same state (the same run's checkpoints, at 2 and at 3
# ranks) plus its load at the other size (a resume of those checkpoints).
# For each model, one job at 2 ranks is grown and shrunk ROUNDS times, with a
# checkpoint every few steps in between.
#   tools/bench_resize.sh [MODELS] [ROUNDS]     (default: mlp,resnet101 3)
# Prints one markdown table; medians with the range (min..max).
set -euo pipefail
cd "$(dirname "$0")/.."
models=${1:-mlp,resnet101}
rounds=${2:-3}
bazel build --jobs=2 //tools:shardrun //tools:shardopt_train //tools:shardctl 2>&1 | tail -n 1
B=bazel-bin/tools
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"' EXIT

# Waits until rank 0 has printed `n` more progress lines than `since`.
progress() { grep -c '\] step [0-9]*/' "$tmp/run.log" || true; }
wait_steps() {  # wait_steps N
  local want=$(( $(progress) + $1 ))
  for _ in $(seq 1 6000); do
    (( $(progress) >= want )) && return 0
    kill -0 "$run" 2>/dev/null || { echo "the job ended early:" >&2; tail "$tmp/run.log" >&2; exit 1; }
    sleep 0.1
  done
  echo "no progress" >&2; exit 1
}
# median and range of numbers on stdin: "m (lo..hi)"
stats() { sort -g | awk '{v[NR]=$1} END {if (NR==0) {print "-"; exit}
  m = NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2; printf "%.2f (%.2f..%.2f)", m, v[1], v[NR]}'; }

echo
echo "| model | change | live resize, s | of it: snapshot / new epoch formed / state loaded, s | moved between ranks, MiB | least possible, MiB | checkpoint save at the old size + load at the new, s |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
IFS=, read -r -a list <<<"$models"
for model in "${list[@]}"; do
  batch=()
  [[ $model == resnet101 ]] && batch=(--batch=8)
  steps=100000
  rm -rf "$tmp/ck" "$tmp/addr"
  $B/shardrun --nproc 2 --port-file="$tmp/addr" --job-id=bench-$model -- $B/shardopt_train \
    --model=$model "${batch[@]}" --steps=$steps --log-every=1 --ckpt-dir="$tmp/ck" --ckpt-every=4 \
    --ckpt-keep=0 >"$tmp/run.log" 2>&1 &
  run=$!
  for _ in $(seq 1 600); do [[ -s "$tmp/addr" ]] && break; sleep 0.1; done
  addr=$(cat "$tmp/addr")
  wait_steps 6
  for _ in $(seq 1 "$rounds"); do
    $B/shardctl --coordinator="$addr" resize --ranks=3 --wait=600 >/dev/null
    wait_steps 6
    $B/shardctl --coordinator="$addr" resize --ranks=2 --wait=600 >/dev/null
    wait_steps 6
  done
  $B/shardctl --coordinator="$addr" abort "benchmark done" >/dev/null
  wait "$run" 2>/dev/null || true
  # Rank 0's lines, in order: checkpoints (by the world size then) and resizes.
  awk -v dir="$tmp/ck" '
    /resized [0-9]+ -> [0-9]+ ranks after step/ {
      match($0, /resized [0-9]+ -> [0-9]+/); split(substr($0, RSTART + 8, RLENGTH - 8), w, " -> ")
      world = w[2]
      match($0, / in [0-9.]+ s \(epoch/); t = substr($0, RSTART + 4, RLENGTH - 13)
      match($0, /snapshot [0-9.]+ s, new epoch formed [0-9.]+ s, state loaded [0-9.]+ s/)
      split(substr($0, RSTART, RLENGTH), p, " ")
      match($0, /moved [0-9.]+ MiB/); moved = substr($0, RSTART + 6, RLENGTH - 10)
      match($0, /changed owner: [0-9.]+ MiB/); least = substr($0, RSTART + 15, RLENGTH - 19)
      print "resize", w[1] "->" w[2], t, p[2], p[7], p[11], moved, least
    }
    /checkpoint .* written in/ {
      match($0, /step-[0-9]+/); step = substr($0, RSTART + 5, RLENGTH - 5)
      match($0, /written in [0-9.]+/); print "save", (world ? world : 2), step, substr($0, RSTART + 11, RLENGTH - 11)
    }' "$tmp/run.log" >"$tmp/events"
  # Loads: a checkpoint saved at 2 ranks resumed at 3, and one saved at 3 at 2.
  for pair in "2 3" "3 2"; do
    read -r from to <<<"$pair"
    for step in $(awk -v w="$from" '$1 == "save" && $2 == w {print $3}' "$tmp/events" | head -n "$rounds"); do
      $B/shardrun --nproc "$to" -- $B/shardopt_train --model=$model "${batch[@]}" \
        --steps=$((step + 1)) --log-every=1000 --resume="$tmp/ck/step-$step" >"$tmp/load.log" 2>&1
      sed -n 's/.*resumed from .* read in \([0-9.]*\) s.*/\1/p' "$tmp/load.log" | sed "s/^/load $from->$to /"
    done
  done >>"$tmp/events"
  for pair in "2 3" "3 2"; do
    read -r from to <<<"$pair"
    sel() { awk -v c="$from->$to" -v k="$1" '$1 == "resize" && $2 == c {print $k}' "$tmp/events"; }
    save=$(awk -v w="$from" '$1 == "save" && $2 == w {print $4}' "$tmp/events" | stats)
    load=$(awk -v c="$from->$to" '$1 == "load" && $2 == c {print $3}' "$tmp/events" | stats)
    echo "| $model | $from -> $to | $(sel 3 | stats) | $(sel 4 | stats) / $(sel 5 | stats) / $(sel 6 | stats) | $(sel 7 | stats) | $(sel 8 | stats) | $save + $load |"
  done
done
