#!/usr/bin/env bash
# Two "hosts" on this machine: network namespaces joined by a veth pair, each
# with its own address in a private subnet created here and removed after.
# One job across them: the coordinator in host 1, ranks in both, Gloo and gRPC
# over the veth link. It trains with checkpoints, then resumes with a
# different number of ranks per host (1+1 -> 2+2).
# Needs root (CAP_NET_ADMIN); without it the test says SKIPPED and why.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
B=tools
id=$$
h1=so-h1-$id; h2=so-h2-$id
net=10.$(( 100 + id % 100 )).$(( id / 100 % 250 ))
tmp=$(mktemp -d)
cleanup() {
  kill $(jobs -p) 2>/dev/null
  ip netns del "$h1" 2>/dev/null
  ip netns del "$h2" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
two_hosts_or_skip "$h1" "$h2" "$net" "mh$id"
echo "hosts: $h1 at $net.1, $h2 at $net.2"

run_job() {  # run_job NPROC_PER_HOST STEPS LOG [trainer flags...]
  local nproc=$1 steps=$2 log=$3; shift 3
  rm -f "$tmp/addr"
  ip netns exec "$h1" timeout 180 $B/shardrun --nnodes=2 --node-rank=0 --nproc="$nproc" \
    --bind="$net.1" --port-file="$tmp/addr" -- \
    $B/shardopt_train --model=small --steps="$steps" --bind="$net.1" "$@" >"$log.0" 2>&1 &
  local p0=$!
  wait_file "$tmp/addr" 30
  ip netns exec "$h2" timeout 180 $B/shardrun --nnodes=2 --node-rank=1 --nproc="$nproc" \
    --coordinator="$(cat "$tmp/addr")" -- \
    $B/shardopt_train --model=small --steps="$steps" --bind="$net.2" "$@" >"$log.1" 2>&1 &
  local p1=$!
  wait $p0; local r0=$?
  wait $p1; local r1=$?
  return $(( r0 != 0 || r1 != 0 ))
}

run_job 1 6 "$tmp/first" --ckpt-dir="$tmp/ck" --ckpt-every=3 --batch=6
check "job across two hosts trains" test $? -eq 0
check "auto transport is gloo across hosts" grep -q "transport gloo (auto: ranks on several hosts)" "$tmp/first.0"
check "coordinator on host 1 at $net.1" grep -q "coordinator listening on $net.1:" "$tmp/first.0"
check "checkpoint committed" grep -q "checkpoint $tmp/ck/step-6 written" "$tmp/first.0"
check "host 2's rank ran" grep -q 'shardrun: all 1 ranks finished' "$tmp/first.1"
run_job 2 9 "$tmp/second" --ckpt-dir="$tmp/ck" --resume="$tmp/ck" --batch=3
check "resumed with 2 ranks per host" test $? -eq 0
check "resume read the 2-rank checkpoint" grep -q 'resumed from .* (sharded, saved by 2 ranks) at step 6' "$tmp/second.0"
check "4-rank job finished" grep -q 'step 9/9' "$tmp/second.0"
if [[ $fails -ne 0 ]]; then tail -n 15 "$tmp"/*.0 "$tmp"/*.1; exit 1; fi
