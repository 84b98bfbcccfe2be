#!/usr/bin/env bash
# Crash trials for checkpoints: a 2-rank job saves a checkpoint every step;
# at a random moment one rank, or shardrun with its coordinator, is killed
# with -9. After each trial LATEST must name a complete checkpoint that
# verifies (every CRC) and that a new job resumes from.
#   tools/ckpt_crash_trials.sh [TRIALS] [MODEL]
set -uo pipefail
cd "$(dirname "$0")/.."
trials=${1:-20}; model=${2:-tiny}
bazel build -c opt //tools:shardrun //tools:shardopt_train //tools:shardctl 2>&1 | tail -n 1
B=bazel-bin/tools
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT
ok=0
for t in $(seq 1 "$trials"); do
  root="$tmp/t$t"
  $B/shardrun --nproc 2 --job-id="crash$t" -- $B/shardopt_train --model="$model" --steps=100000 \
    --log-every=100000 --ckpt-dir="$root" --ckpt-every=1 >"$tmp/t$t.log" 2>&1 &
  run=$!
  for _ in $(seq 1 100); do [[ -s "$root/LATEST" ]] && break; sleep 0.05; done
  sleep "0.$(( RANDOM % 10 ))$(( RANDOM % 10 ))"
  case $(( RANDOM % 3 )) in
    0) target=$run; what="shardrun+coordinator" ;;
    *) r=$(( RANDOM % 2 )); what="rank $r"
       target=$(for p in $(pgrep -f shardopt_train); do
         tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -x "SHARDOPT_JOB_ID=crash$t" >/dev/null &&
         tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -x "RANK=$r" >/dev/null && echo "$p"; done) ;;
  esac
  kill -9 $target 2>/dev/null
  wait $run 2>/dev/null
  sleep 1  # survivors of a killed launcher stop on their own
  latest=$(cat "$root/LATEST" 2>/dev/null)
  partial=$(ls -d "$root"/step-* | wc -l)
  if $B/shardctl inspect "$root" >"$tmp/inspect$t" 2>&1 &&
     timeout 120 $B/shardrun --nproc 1 --job-id="resume$t" -- $B/shardopt_train --model="$model" \
       --steps=$(( ${latest#step-} + 1 )) --resume="$root" >"$tmp/resume$t.log" 2>&1; then
    ok=$((ok + 1)); verdict=ok
  else
    verdict=FAILED
  fi
  echo "trial $t: killed $what; LATEST=$latest ($partial step directories, incl. unfinished); verify + resume: $verdict"
done
echo "$ok of $trials trials left a complete, verifiable, resumable LATEST"
[[ $ok -eq $trials ]]
