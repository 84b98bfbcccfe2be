#!/usr/bin/env bash
# Python jobs under shardrun: the script's own torch.distributed group works
# beside shardopt (MASTER_PORT is its own); shardctl layout --json lists the
# Python job's parameters; set-lr reaches param_groups; a rank killed with
# SIGKILL makes the job fail naming it; a rank that leaves its loop early is named as such.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
root=$PWD
tmp=$(mktemp -d)
pid=""
trap '[[ -n $pid ]] && kill -9 $pid 2>/dev/null; rm -rf "$tmp"' EXIT
export PYTHONPATH="$root/python"
fail() { echo "FAIL: $*"; echo "--- job log"; cat "$tmp/job.log"; exit 1; }
logged() { grep -q "$1" "$tmp/job.log" 2>/dev/null; }  # logged PATTERN: in the job's output
ctl() { "$root/tools/shardctl" --coordinator="$(cat "$tmp/port")" "$@"; }

# 1. layout, set-lr, torch.distributed beside shardopt.
timeout 240 tools/shardrun --nproc 2 --port-file="$tmp/port" -- /usr/bin/python3 \
  tests/python/shardrun_job.py --steps=300 >"$tmp/job.log" 2>&1 &
pid=$!
wait_until 60 "the script's all_reduce" logged "torch.distributed all_reduce: 3" ||
  fail "the script's own process group did not work"
layout_lists() { ctl layout --json >"$tmp/layout.json" 2>/dev/null && grep -q '0.weight' "$tmp/layout.json"; }
wait_until 20 "shardctl layout --json to list 0.weight" layout_lists
grep -q '"0.weight' "$tmp/layout.json" && grep -q '"2.weight"' "$tmp/layout.json" || fail "shardctl layout --json does not list the parameters: $(head -c 400 "$tmp/layout.json")"
grep -q '"0.bias\|"2.bias' "$tmp/layout.json" || fail "layout misses the biases"
echo "shardctl layout --json lists the Python job's parameters"
# batch_size= makes heartbeats carry samples/s (it was 0.0 for Python jobs).
sps=""
rank0_sps() {
  sps=$(ctl status 2>/dev/null | awk '$1 == "0" && $3 ~ /^[0-9]+$/ {print $5}')
  [[ -n "$sps" && "$sps" != "0.0" ]]
}
wait_until 10 "samples/s of rank 0 in shardctl status" rank0_sps
[[ -n "$sps" && "$sps" != "0.0" ]] || fail "shardctl status shows no samples/s for rank 0: '$sps'"
echo "shardctl status: rank 0 at $sps samples/s"
ctl set-lr 0.0025 || fail "set-lr failed"
wait_until 30 "param_groups lr 0.0025 in the job's output" logged "param_groups lr 0.0025" ||
  fail "set-lr did not reach param_groups"
echo "set-lr reached param_groups: $(grep -m1 'param_groups lr' "$tmp/job.log")"
wait $pid || fail "the job failed"
pid=""
grep -q "shardrun: all 2 ranks finished" "$tmp/job.log" || fail "no clean finish"

# 2. kill -9 of one Python rank: the other exits, the job fails naming it.
rm -f "$tmp/port"
timeout 240 tools/shardrun --nproc 2 --port-file="$tmp/port" --heartbeat-timeout=3 -- \
  /usr/bin/python3 tests/python/shardrun_job.py --steps=100000 >"$tmp/job.log" 2>&1 &
pid=$!
wait_until 60 "the script's all_reduce" logged "torch.distributed all_reduce" || fail "job did not start"
victim=""
found_victim() { victim=$(rank_pid "" 1 shardrun_job.py | sed -n 1p); [[ -n $victim ]]; }
wait_until 10 "rank 1's process" found_victim
[[ -n $victim ]] || fail "rank 1's process not found"
# Mid-run: both ranks have their optimizer and report steps.
wait_until 30 "the job past step 1" job_past_step "$(cat "$tmp/port")" 1
kill -9 "$victim"
start=$(date +%s)
wait $pid; rc=$?
pid=""
took=$(( $(date +%s) - start ))
[[ $rc -ne 0 ]] || fail "shardrun exited 0 after a rank was killed"
grep -Eq "rank 1" "$tmp/job.log" || fail "the failure does not name rank 1"
(( took <= 60 )) || fail "the job took ${took}s to stop"
echo "kill -9 of rank 1: job failed in ${took}s: $(grep -m1 -E 'shardrun: job failed|FAILED|rank 1' "$tmp/job.log")"
# 3. Rank 0 leaves its loop early (a script bug): rank 1, waiting for the
# next step, is told so at once, not that rank 0 sent no heartbeat.
rm -f "$tmp/port"
start=$(date +%s)
timeout 120 tools/shardrun --nproc 2 -- /usr/bin/python3 tests/python/shardrun_job.py --steps=8 \
  --rank0-steps=5 --step-sleep=0 >"$tmp/job.log" 2>&1
rc=$?
took=$(( $(date +%s) - start ))
[[ $rc -ne 0 ]] || fail "shardrun exited 0 although rank 1 could not finish"
grep -q "rank 0 finished its loop at step 5 while rank 1 waited for step 6" "$tmp/job.log" ||
  fail "the failure does not say that rank 0 left its loop"
(( took <= 30 )) || fail "the early exit took ${took}s to report"
echo "rank 0 left early: reported in ${took}s: $(grep -m1 'shardrun: job failed' "$tmp/job.log")"
# 4. state_dict() on rank 0 only, no torch.distributed group: it fails within
# seconds naming the rank that did not come (through the coordinator).
timeout 120 tools/shardrun --nproc 2 -- /usr/bin/python3 tests/python/shardrun_job.py --steps=50 \
  --no-torch-group --state-dict-on-rank0=3 --step-sleep=0 >"$tmp/job.log" 2>&1
rc=$?
[[ $rc -ne 0 ]] || fail "shardrun exited 0 although state_dict() ran on one rank"
grep -q "state_dict on rank 0 alone failed after .* rank(s) 1 did not within" "$tmp/job.log" ||
  fail "state_dict() on one rank was not refused naming rank 1"
echo "state_dict() on rank 0 alone: $(grep -m1 'state_dict on rank 0 alone' "$tmp/job.log" | cut -c1-160)"
echo "PASS"
