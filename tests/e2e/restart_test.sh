#!/usr/bin/env bash
# shardrun --max-restarts: a rank killed with kill -9 mid-training does not
# end the job. shardrun stops the others, says which rank was lost and how
# many steps, and starts the survivors again (3 -> 2 ranks) from the last
# complete checkpoint (shardopt_train resumes from --ckpt-dir when
# SHARDOPT_RESTART > 0). The result equals, bit for bit, a run that resumed
# the same checkpoint at 2 ranks by hand. Then the limits: --min-ranks and
# --max-restarts stop restarting, and bad flags are refused.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
B=tools
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT

steps=300
train=(--model=small --batch=64 --steps=$steps --ckpt-every=10 --log-every=50)
# (rank 0 sleeps 20 ms a step so that the kill lands mid-run; numerics unchanged)
timeout 180 $B/shardrun --nproc 3 --max-restarts=1 --port-file="$tmp/addr" --job-id=restart \
  --metrics-port=0 --metrics-port-file="$tmp/maddr" -- \
  $B/shardopt_train "${train[@]}" --debug-slow-rank=0 --debug-slow-ms=20 --ckpt-dir="$tmp/ck" \
  >"$tmp/run.log" 2>&1 &
run=$!
check "job starts" wait_file "$tmp/addr" 60
check "it trains past step 40" wait_until 60 "step 40" job_past_step "$(cat "$tmp/addr")" 40
victim=$(rank_pid restart 2)
check "rank 2 found" test -n "$victim"
kill -9 $victim
# While the restarted job trains: shardctl status and /metrics say so.
restart_shown() {
  timeout 10 $B/shardctl --coordinator="$(cat "$tmp/addr")" status >"$tmp/status.log" 2>&1
  grep -q "^restarts: 1" "$tmp/status.log"
}
wait_until 60 "shardctl status to show the restart" restart_shown
/usr/bin/python3 -c 'import sys, urllib.request; print(urllib.request.urlopen("http://" + open(sys.argv[1]).read().strip() + "/metrics", timeout=10).read().decode())' \
  "$tmp/maddr" >"$tmp/metrics.log" 2>&1
wait $run
check "the restarted job finishes (exit 0)" test $? -eq 0
line=$(grep 'shardrun: job failed at step' "$tmp/run.log")
echo "$line"
check "the restart line names the lost rank and the steps" \
  grep -q "shardrun: job failed at step [0-9]*: rank 2 was killed by signal 9; lost rank 2; restart 1 of 1 with 2 ranks from the checkpoint of step [0-9]* ([0-9]* steps lost)" \
  "$tmp/run.log"
saved=$(echo "$line" | sed -n 's/.*from the checkpoint of step \([0-9]*\) .*/\1/p')
reached=$(echo "$line" | sed -n 's/.*job failed at step \([0-9]*\):.*/\1/p')
lost=$(echo "$line" | sed -n 's/.*(\([0-9]*\) steps lost).*/\1/p')
check "at most the steps since the last checkpoint are lost ($lost of every 10)" \
  test "$lost" -le 10 -a "$lost" -eq $((reached - saved))
check "the survivors resumed it at 2 ranks" \
  grep -q "resumed from $tmp/ck/step-$saved (sharded, saved by 3 ranks) at step $saved" "$tmp/run.log"
check "the resumed rank 0 says the same" \
  grep -q "restart 1: the job had reached step $reached; $lost steps lost" "$tmp/run.log"
check "2 ranks finished" grep -q "shardrun: all 2 ranks finished" "$tmp/run.log"
check "shardctl status showed the restart" grep -q "^restarts: 1; last: job failed at step $reached" \
  "$tmp/status.log"
check "/metrics counted it" grep -q "^shardopt_job_restarts_total 1" "$tmp/metrics.log"

# The same checkpoint resumed at 2 ranks by hand.
timeout 120 $B/shardrun --nproc 2 -- $B/shardopt_train "${train[@]}" \
  --resume="$tmp/ck/step-$saved" --ckpt-dir="$tmp/ref" >"$tmp/ref.log" 2>&1
check "resume by hand at 2 ranks" test $? -eq 0
$B/shardctl consolidate "$tmp/ck/step-$steps" "$tmp/restarted.st" >/dev/null 2>&1
$B/shardctl consolidate "$tmp/ref/step-$steps" "$tmp/ref.st" >/dev/null 2>&1
check "parameters and optimizer state equal the by-hand resume bit for bit" \
  cmp "$tmp/restarted.st" "$tmp/ref.st"
check "every checkpoint of the restarted run verifies" \
  bash -c "$B/shardctl inspect '$tmp/ck' | grep -q 'verify: every CRC matches'"

# The same from Python: a script that resumes when ctx.restart > 0.
export PYTHONPATH=$PWD/python
job=(tests/python/launcher_job.py --steps=60 --ckpt-every=5)
timeout 180 $B/shardrun --nproc 3 --max-restarts=1 --port-file="$tmp/addr3" --job-id=pyrestart -- \
  /usr/bin/python3 "${job[@]}" --step-sleep=0.05 --ckpt-dir="$tmp/pyck" --out="$tmp/py.pt" \
  >"$tmp/py.log" 2>&1 &
run=$!
check "Python job starts" wait_file "$tmp/addr3" 60
check "... trains past step 12" wait_until 60 "step 12" job_past_step "$(cat "$tmp/addr3")" 12
kill -9 $(rank_pid pyrestart 2 launcher_job)
wait $run
check "the restarted Python job finishes (exit 0)" test $? -eq 0
pysaved=$(sed -n 's/.*from the checkpoint of step \([0-9]*\) .*/\1/p' "$tmp/py.log")
check "the script resumed at 2 ranks where shardrun said" \
  grep -q "restart 1: resumed at step $pysaved" "$tmp/py.log"
timeout 120 $B/shardrun --nproc 2 -- /usr/bin/python3 "${job[@]}" \
  --resume="$tmp/pyck/step-$pysaved" --out="$tmp/py_ref.pt" >"$tmp/py_ref.log" 2>&1
check "by hand: the same checkpoint at 2 ranks" test $? -eq 0
check "parameters, buffers and optimizer state bitwise the by-hand resume's" \
  /usr/bin/python3 tests/python/compare_states.py "$tmp/py.pt" "$tmp/py_ref.pt"

# --min-ranks: 2 ranks, one lost, 1 left under --min-ranks=2: no restart.
timeout 120 $B/shardrun --nproc 2 --max-restarts=3 --min-ranks=2 --port-file="$tmp/addr2" \
  --job-id=minranks -- $B/shardopt_train --model=small --batch=64 --steps=100000 \
  --ckpt-every=10 --log-every=50 --ckpt-dir="$tmp/ck2" >"$tmp/min.log" 2>&1 &
run=$!
check "second job trains" wait_file "$tmp/addr2" 60
check "... past step 5" wait_until 60 "step 5" job_past_step "$(cat "$tmp/addr2")" 5
kill -9 $(rank_pid minranks 1)
wait $run
check "no restart under --min-ranks (exit 1)" test $? -eq 1
check "it says why" grep -q "not restarting: 1 ranks would be left, under --min-ranks=2" \
  "$tmp/min.log"

# --max-restarts used up: a NaN at step 3 fails every attempt the same way.
timeout 120 $B/shardrun --nproc 2 --max-restarts=2 -- $B/shardopt_train --model=tiny \
  --steps=5 --debug-nan-rank=1 --debug-nan-step=3 >"$tmp/nan.log" 2>&1
check "a job that fails every time stops (exit 1)" test $? -eq 1
check "after two restarts" test "$(grep -c 'restart [12] of 2 with 2 ranks' "$tmp/nan.log")" -eq 2
check "it says why" grep -q "not restarting: --max-restarts=2 used up" "$tmp/nan.log"

refused() {  # refused NAME TEXT ARGS...
  local name=$1 text=$2
  shift 2
  timeout 30 $B/shardrun "$@" -- /bin/true >"$tmp/refused.log" 2>&1
  local rc=$?
  check "$name refused (exit $rc)" test $rc -eq 2
  check "$name: names $text" grep -q -- "$text" "$tmp/refused.log"
}
refused "--max-restarts=-1" "--max-restarts" --nproc 2 --max-restarts=-1
refused "--min-ranks above the job" "--min-ranks=3 is more than" --nproc 2 --min-ranks=3
refused "--max-restarts with --nnodes=2" "one node" --nproc 1 --nnodes=2 --max-restarts=1

if [[ $fails -ne 0 ]]; then
  for f in "$tmp"/*.log; do echo "--- $f"; grep -v '^\(\[rank [0-9]*\] \)\?\[#' "$f" | tail -n 12; done
  exit 1
fi
