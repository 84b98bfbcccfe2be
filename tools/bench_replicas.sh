#!/usr/bin/env bash
# The cost and the gain of shardrun --replicate-shards (docs/elastic.md), at 3
# ranks on this machine:
# - cost: training time of the same job without replicas and with a refresh
#   every K steps (each K of KS), side by side in one run, ROUNDS times
#   interleaved; the mean refresh time; the memory the replicas hold on rank 0
#   against its live optimizer state;
# - gain: the same job with one rank killed (SIGKILL) halfway, recovered from
#   the replicas (K = the first of KS) against restarted from its last
#   checkpoint (--max-restarts=1, a checkpoint every K steps): the whole job's
#   wall time, and the pause the recovery took.
#   tools/bench_replicas.sh [MODELS] [STEPS] [KS] [ROUNDS]   (default: mlp,resnet101 60 10,50 2)
# Prints one markdown table per part.
set -euo pipefail
cd "$(dirname "$0")/.."
models=${1:-mlp,resnet101}
steps=${2:-60}
ks=${3:-10,50}
rounds=${4:-2}
bazel build --jobs=2 //tools:shardrun //tools:shardopt_train 2>&1 | tail -n 1
B=bazel-bin/tools
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$tmp"' EXIT
IFS=, read -r -a model_list <<<"$models"
IFS=, read -r -a k_list <<<"$ks"
median() { sort -g | awk '{v[NR]=$1} END {if (NR==0) {print "-"; exit}
  printf "%.2f", NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}'; }
# train TAG MODEL [SHARDRUN FLAGS...]: one job; its log in $tmp/TAG.log.
train() {
  local tag=$1 model=$2
  shift 2
  local batch=()
  [[ $model == resnet101 ]] && batch=(--batch=8)
  $B/shardrun --nproc 3 "$@" -- $B/shardopt_train --model="$model" "${batch[@]}" \
    --steps="$steps" --log-every=1 >"$tmp/$tag.log" 2>&1
}
done_seconds() { sed -n 's/.*done: [0-9]* steps in \([0-9.]*\) s.*/\1/p' "$1" | tail -n 1; }

echo
echo "| model | replicas | training time, s (median of $rounds) | vs none | refresh, s (mean) | rank 0 holds in replicas, MiB | its live optimizer state (master + moments), MiB |"
echo "| --- | --- | --- | --- | --- | --- | --- |"
for model in "${model_list[@]}"; do
  for round in $(seq 1 "$rounds"); do
    train "none-$round" "$model"
    for k in "${k_list[@]}"; do train "k$k-$round" "$model" --replicate-shards="$k"; done
  done
  base=$(for r in $(seq 1 "$rounds"); do done_seconds "$tmp/none-$r.log"; done | median)
  state=$(sed -n 's/.*rank 0 holds optimizer state \([0-9.]*\) MiB.*/\1/p' "$tmp/none-1.log" | tail -n 1)
  echo "| $model | none | $base | 1.00 | - | - | - |"
  for k in "${k_list[@]}"; do
    t=$(for r in $(seq 1 "$rounds"); do done_seconds "$tmp/k$k-$r.log"; done | median)
    refresh=$(for r in $(seq 1 "$rounds"); do
      sed -n 's/.*replicas: refreshed [0-9]* times, \([0-9.]*\) s each.*/\1/p' "$tmp/k$k-$r.log"
    done | median)
    held=$(sed -n 's/.*rank 0 holds \([0-9.]*\) MiB (its own state.*/\1/p' "$tmp/k$k-1.log" | head -n 1)
    echo "| $model | every $k steps | $t | $(awk -v a="$t" -v b="$base" 'BEGIN {printf "%.2f", a / b}') | $refresh | $held | $(awk -v s="$state" 'BEGIN {printf "%.1f", s * 1.5}') |"
  done
done

k=${k_list[0]}
echo
echo "| model | one rank killed at step $((steps / 2)) of $steps | job wall time, s | steps lost | pause, s |"
echo "| --- | --- | --- | --- | --- |"
# killed TAG MODEL [SHARDRUN FLAGS...]: the job, rank 2 killed at step steps/2; wall seconds.
killed() {
  local tag=$1 model=$2
  shift 2
  local batch=()
  [[ $model == resnet101 ]] && batch=(--batch=8)
  rm -rf "$tmp/ck"
  local t0
  t0=$(date +%s.%N)
  $B/shardrun --nproc 3 --job-id="$tag" "$@" -- $B/shardopt_train --model="$model" "${batch[@]}" \
    --steps="$steps" --log-every=1 --ckpt-dir="$tmp/ck" --ckpt-every="$k" >"$tmp/$tag.log" 2>&1 &
  local run=$!
  until grep -q "\] step $((steps / 2))/" "$tmp/$tag.log" 2>/dev/null; do
    kill -0 "$run" 2>/dev/null || { echo "the job ended early" >&2; tail "$tmp/$tag.log" >&2; exit 1; }
    sleep 0.05
  done
  for p in $(pgrep -f shardopt_train); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "SHARDOPT_JOB_ID=$tag" &&
       tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=2"; then kill -9 "$p"; fi
  done
  wait "$run"
  awk -v a="$(date +%s.%N)" -v b="$t0" 'BEGIN {printf "%.1f", a - b}'
}
for model in "${model_list[@]}"; do
  wall=$(killed "rep-$model" "$model" --replicate-shards="$k")
  line=$(grep -m1 "recovered in" "$tmp/rep-$model.log")
  pause=$(echo "$line" | sed -n 's/.*recovered in \([0-9.]*\) s.*/\1/p')
  lost=$(echo "$line" | sed -n 's/.*(\([0-9]*\) steps lost).*/\1/p')
  echo "| $model | recovered from the replicas (every $k steps) | $wall | $lost | $pause |"
  wall=$(killed "restart-$model" "$model" --max-restarts=1)
  lost=$(sed -n 's/.*(\([0-9]*\) steps lost).*/\1/p' "$tmp/restart-$model.log" | head -n 1)
  echo "| $model | restarted from the checkpoint (every $k steps) | $wall | $lost | - |"
done
