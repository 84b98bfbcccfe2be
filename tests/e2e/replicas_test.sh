#!/usr/bin/env bash
# shardrun --replicate-shards (docs/elastic.md): every K steps each rank keeps
# its owned optimizer state and its successor's in memory. A rank killed with
# SIGKILL is dropped and the others go on at the smaller size from the newest
# replicas, without a restart, losing only the steps since then (and saying
# how many); the final state equals, bit for bit, a checkpoint of that step
# resumed at the smaller size. Rank 0 (whose replica holds the checkpoint
# manifest) can be lost too. A loss before the first refresh falls back to
# --max-restarts. Bad flags are refused.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
B=tools
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
# (rank 0 sleeps 20 ms a step so that the kills land mid-run; numerics unchanged)
train=(--model=small --batch=64 --log-every=100 --debug-slow-rank=0 --debug-slow-ms=20)

# 1. kill -9 of rank 1 of 3, replicas every 5 steps, a checkpoint every 5 too.
timeout 240 $B/shardrun --nproc 3 --replicate-shards=5 --port-file="$tmp/addr" --job-id=rep -- \
  $B/shardopt_train "${train[@]}" --steps=700 --ckpt-dir="$tmp/ck" --ckpt-every=5 \
  >"$tmp/run.log" 2>&1 &
run=$!
check "job starts" wait_file "$tmp/addr" 60
check "it trains past step 30" wait_until 60 "step 30" job_past_step "$(cat "$tmp/addr")" 30
kill -9 "$(rank_pid rep 1)"
wait $run
check "the job finishes without a restart (exit $?)" test $? -eq 0
check "shardrun says rank 1 was lost and the others go on" grep -q \
  "shardrun: rank 1 was lost (rank 1 was killed by signal 9); the other 2 ranks go on from their in-memory replicas (epoch 1)" \
  "$tmp/run.log"
line=$(grep -m1 "recovered in [0-9.]* s from the in-memory replicas of step" "$tmp/run.log")
echo "$line"
r=$(echo "$line" | sed -n 's/.*replicas of step \([0-9]*\) (\([0-9]*\) steps lost).*/\1/p')
lost=$(echo "$line" | sed -n 's/.*replicas of step \([0-9]*\) (\([0-9]*\) steps lost).*/\2/p')
check "rank 0 says from which step ($r) it went on" test -n "$r"
check "... and that at most the steps since the last refresh were lost ($lost)" \
  test -n "$lost" -a "${lost:-99}" -le 10
check "it went on with 2 ranks" grep -q "2 ranks now (epoch 1)" "$tmp/run.log"
check "no restart" test "$(grep -c "restart 1" "$tmp/run.log")" -eq 0
check "shardrun's last line counts the loss" \
  grep -q "shardrun: all 2 remaining ranks finished (1 lost, recovered from the in-memory replicas)" \
  "$tmp/run.log"
check "rank 0 reports the refreshes" grep -q "^\[rank 0\] replicas: refreshed [0-9]* times" "$tmp/run.log"
timeout 120 $B/shardrun --nproc 2 -- $B/shardopt_train "${train[@]}" --steps=700 \
  --resume="$tmp/ck/step-$r" --ckpt-dir="$tmp/ref" >"$tmp/ref.log" 2>&1
check "reference: the checkpoint of step $r resumed at 2 ranks" test $? -eq 0
$B/shardctl consolidate "$tmp/ck/step-700" "$tmp/live.st" >/dev/null 2>&1
$B/shardctl consolidate "$tmp/ref/step-700" "$tmp/ref.st" >/dev/null 2>&1
check "parameters and optimizer state equal the reference's bit for bit" cmp "$tmp/live.st" "$tmp/ref.st"

# 2. Rank 0 lost: its replica (with the checkpoint manifest) is rank 2's.
timeout 240 $B/shardrun --nproc 3 --replicate-shards=3 --port-file="$tmp/addr2" --job-id=rep0 -- \
  $B/shardopt_train "${train[@]}" --steps=400 >"$tmp/rank0.log" 2>&1 &
run=$!
check "second job starts" wait_file "$tmp/addr2" 60
check "... trains past step 20" wait_until 60 "step 20" job_past_step "$(cat "$tmp/addr2")" 20
kill -9 "$(rank_pid rep0 0)"
# shardctl status and top show the change while the job goes on.
shows_loss() {
  $B/shardctl --coordinator="$(cat "$tmp/addr2")" status >"$tmp/status.txt" 2>&1 &&
    grep -q "^membership: epoch 1; last change at step [0-9]*: 3 -> 2 ranks, lost (recovered from replicas): 0, " "$tmp/status.txt" &&
    $B/shardctl --coordinator="$(cat "$tmp/addr2")" top --once >"$tmp/top.txt" 2>&1 &&
    grep -q "^membership: epoch 1; .*lost (recovered from replicas): 0" "$tmp/top.txt"
}
check "shardctl status and top show rank 0's loss" wait_until 60 "the loss in status and top" shows_loss
wait $run
check "after rank 0's loss the job finishes (exit $?)" test $? -eq 0
check "the new rank 0 says it recovered" \
  grep -q "rank 0 was lost during step [0-9]*; recovered in" "$tmp/rank0.log"

# 3. A loss before the first refresh: nothing to recover from in memory, so
# --max-restarts restarts the job from its checkpoint.
timeout 240 $B/shardrun --nproc 3 --replicate-shards=100000 --max-restarts=1 \
  --port-file="$tmp/addr3" --job-id=early -- \
  $B/shardopt_train "${train[@]}" --steps=300 --ckpt-dir="$tmp/ck3" --ckpt-every=10 \
  >"$tmp/early.log" 2>&1 &
run=$!
check "third job starts" wait_file "$tmp/addr3" 60
check "... trains past step 20" wait_until 60 "step 20" job_past_step "$(cat "$tmp/addr3")" 20
kill -9 "$(rank_pid early 1)"
wait $run
check "the job finishes after a restart (exit $?)" test $? -eq 0
check "shardrun says why the replicas could not be used" \
  grep -q "shardrun: cannot recover from the replicas: rank 0 holds no replica yet in epoch 0" \
  "$tmp/early.log"
check "... and restarts from the checkpoint" \
  grep -q "restart 1 of 1 with 2 ranks from the checkpoint of step" "$tmp/early.log"

# 4. Flags.
timeout 30 $B/shardrun --nproc 2 --replicate-shards=0 -- true >"$tmp/flag.log" 2>&1
check "--replicate-shards=0 refused (exit $?)" test $? -eq 2
timeout 30 $B/shardrun --nproc 2 --nnodes=2 --replicate-shards=5 -- true >"$tmp/flag2.log" 2>&1
check "--replicate-shards with --nnodes=2 refused (exit $?)" test $? -eq 2
check "... saying why" grep -q "replicate-shards works on one node" "$tmp/flag2.log"

if [[ $fails -ne 0 ]]; then
  for f in "$tmp"/*.log; do echo "--- $f"; grep -v '^\(\[rank [0-9]*\] \)\?\[#' "$f" | tail -n 15; done
  exit 1
fi
