#!/usr/bin/env bash
# The main job: a 2-rank CPU training run of the mlp model (42M parameters)
# with shard-owner services and a coordinator, queried with shardctl while it
# trains (status, layout, memory), checkpointing every 10 steps (listed and
# verified at the end). Builds what it needs first.
#   tools/demo.sh [--steps=N] [--model=NAME] [other shardopt_train flags]
set -euo pipefail
cd "$(dirname "$0")/.."

bazel build -c opt //tools:shardrun //tools:shardopt_train //tools:shardctl 2>&1 | tail -n 1
B=bazel-bin/tools
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

args=("$@")
[[ " ${args[*]-} " == *" --model="* ]] || args+=(--model=mlp)
[[ " ${args[*]-} " == *" --steps="* ]] || args+=(--steps=30)
# The checkpoints go where the user said (--ckpt-dir=DIR), else to a
# temporary folder that is listed and verified at the end.
ckpt="$tmp/checkpoints"
for a in "${args[@]}"; do
  [[ $a == --ckpt-dir=* ]] && ckpt="${a#--ckpt-dir=}"
done
[[ " ${args[*]-} " == *" --ckpt-dir="* ]] || args+=(--ckpt-dir="$ckpt" --ckpt-every=10)

"$B/shardrun" --nproc 2 --port-file "$tmp/coordinator" -- \
  "$B/shardopt_train" "${args[@]}" &
run=$!

for _ in $(seq 1 300); do [[ -s "$tmp/coordinator" ]] && break; sleep 0.1; done
if [[ ! -s "$tmp/coordinator" ]]; then
  echo "demo: the coordinator did not start" >&2
  wait $run || true
  exit 1
fi
export SHARDOPT_COORDINATOR=$(cat "$tmp/coordinator")

echo "== shardctl status (waits until both ranks joined)"
"$B/shardctl" status --wait=120 || true
echo "== shardctl layout"
"$B/shardctl" layout || true
echo "== shardctl memory"
"$B/shardctl" memory || true

rc=0
wait $run || rc=$?
echo "== shardctl checkpoints $ckpt"
"$B/shardctl" checkpoints "$ckpt" || true
echo "== shardctl inspect (verifies every CRC)"
"$B/shardctl" inspect "$ckpt" || true
if [[ $rc -ne 0 ]]; then
  echo "demo: the training job failed (exit status $rc)" >&2
  exit "$rc"
fi
