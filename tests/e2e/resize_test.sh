#!/usr/bin/env bash
# Live resize (docs/elastic.md): a running shardopt_train job grows from 2 to
# 3 ranks (shardctl resize; shardrun starts the new rank, which takes its
# state from the others) and then shrinks back to 2 (shardctl drain of a
# middle rank, which hands its state over and leaves), without a restart.
# Its final parameters and optimizer state equal, bit for bit, those of runs
# that checkpointed at the same steps and resumed at the new size. Then
# --on-sigterm=drain: a SIGTERM drains its rank; a rank killed after a grow
# with --max-restarts: the job restarts at the size left. And the refusals: a
# resize to the same size, a drain of a rank that does not exist, a job whose
# trainer (Python) cannot resize live.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
B=tools
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT

steps=1000  # (long enough for both resizes however loaded the machine: >= 20 s at 20 ms a step)
train=(--model=small --batch=64 --log-every=50)
# (rank 0 sleeps 20 ms a step so that the resizes land mid-run; numerics unchanged)
timeout 240 $B/shardrun --nproc 2 --port-file="$tmp/addr" --job-id=resize \
  --metrics-port=0 --metrics-port-file="$tmp/maddr" -- \
  $B/shardopt_train "${train[@]}" --steps=$steps --debug-slow-rank=0 --debug-slow-ms=20 --ckpt-dir="$tmp/ck" \
  >"$tmp/run.log" 2>&1 &
run=$!
check "job starts" wait_file "$tmp/addr" 60
addr=$(cat "$tmp/addr")
check "it trains past step 30" wait_until 60 "step 30" job_past_step "$addr" 30
timeout 90 $B/shardctl --coordinator="$addr" resize --ranks=3 --wait=60 >"$tmp/grow.log" 2>&1
check "shardctl resize --ranks=3 completes (exit $?)" test $? -eq 0
cat "$tmp/grow.log"
s1=$(sed -n 's/^epoch 1 at step \([0-9]*\): 2 -> 3 ranks (joined: 2) in .*/\1/p' "$tmp/grow.log")
check "it says at which step rank 2 joined ($s1)" test -n "$s1"
check "the job trains on at 3 ranks past step $((s1 + 30))" \
  wait_until 60 "step $((s1 + 30))" job_past_step "$addr" $((s1 + 30))
timeout 30 $B/shardctl --coordinator="$addr" status >"$tmp/status.log" 2>&1
/usr/bin/python3 -c 'import sys, urllib.request; print(urllib.request.urlopen("http://" + open(sys.argv[1]).read().strip() + "/metrics", timeout=10).read().decode())' \
  "$tmp/maddr" >"$tmp/metrics.log" 2>&1
timeout 90 $B/shardctl --coordinator="$addr" drain --rank=1 --wait=60 >"$tmp/drain.log" 2>&1
check "shardctl drain --rank=1 completes (exit $?)" test $? -eq 0
cat "$tmp/drain.log"
s2=$(sed -n 's/^epoch 2 at step \([0-9]*\): 3 -> 2 ranks (left: 1) in .*/\1/p' "$tmp/drain.log")
check "it says at which step rank 1 left ($s2)" test -n "$s2"
wait $run
check "the job finishes (exit $?)" test $? -eq 0
check "shardrun started rank 2 for the grow" \
  grep -q "shardrun: starting rank 2 to grow the job to 3 ranks (epoch 1)" "$tmp/run.log"
check "rank 2 joined at step $s1" grep -q "rank 2 joined the job at step $s1 (epoch 1, 3 ranks)" \
  "$tmp/run.log"
check "rank 0 says what the grow moved" \
  grep -q "resized 2 -> 3 ranks after step $s1 in [0-9.]* s (epoch 1; .*): moved" "$tmp/run.log"
check "rank 1 left after step $s2" grep -q "rank 1 leaves the job after step $s2" "$tmp/run.log"
check "rank 0 says what the drain moved" \
  grep -q "resized 3 -> 2 ranks after step $s2 in [0-9.]* s (epoch 2; " "$tmp/run.log"
check "shardctl status showed the membership" \
  grep -q "^membership: epoch 1; last change at step $s1: 2 -> 3 ranks, joined: 2" "$tmp/status.log"
check "... and 3 ranks" grep -q "finished\|running, 3 ranks" "$tmp/status.log"
check "/metrics showed the epoch" grep -q "^shardopt_job_membership_epoch 1" "$tmp/metrics.log"

# The same by hand, through checkpoints: 2 ranks to s1, 3 ranks to s2, 2 to the end.
timeout 120 $B/shardrun --nproc 2 -- $B/shardopt_train "${train[@]}" --steps=$s1 \
  --ckpt-dir="$tmp/ref" >"$tmp/ref1.log" 2>&1
check "reference: 2 ranks to step $s1" test $? -eq 0
timeout 120 $B/shardrun --nproc 3 -- $B/shardopt_train "${train[@]}" --steps=$s2 \
  --resume="$tmp/ref/step-$s1" --ckpt-dir="$tmp/ref" >"$tmp/ref2.log" 2>&1
check "reference: resumed at 3 ranks to step $s2" test $? -eq 0
timeout 120 $B/shardrun --nproc 2 -- $B/shardopt_train "${train[@]}" --steps=$steps \
  --resume="$tmp/ref/step-$s2" --ckpt-dir="$tmp/ref" >"$tmp/ref3.log" 2>&1
check "reference: resumed at 2 ranks to the end" test $? -eq 0
$B/shardctl consolidate "$tmp/ck/step-$steps" "$tmp/live.st" >/dev/null 2>&1
$B/shardctl consolidate "$tmp/ref/step-$steps" "$tmp/ref.st" >/dev/null 2>&1
check "parameters and optimizer state equal the checkpoint-and-resume runs' bit for bit" \
  cmp "$tmp/live.st" "$tmp/ref.st"

# --on-sigterm=drain: SIGTERM to rank 1 of 3 drains it; the job goes on at 2.
timeout 180 $B/shardrun --nproc 3 --port-file="$tmp/addr3" --job-id=sigterm -- \
  $B/shardopt_train "${train[@]}" --steps=400 --debug-slow-rank=0 --debug-slow-ms=20 \
  --on-sigterm=drain >"$tmp/sigterm.log" 2>&1 &
run=$!
check "third job starts" wait_file "$tmp/addr3" 60
check "... trains past step 20" wait_until 60 "step 20" job_past_step "$(cat "$tmp/addr3")" 20
kill -TERM "$(rank_pid sigterm 1)"
wait $run
check "after SIGTERM to rank 1 the job finishes (exit $?)" test $? -eq 0
check "rank 1 says it drains" \
  grep -q "rank 1 got SIGTERM: it leaves the job at the next step boundary" "$tmp/sigterm.log"
check "... and leaves" grep -q "rank 1 leaves the job after step" "$tmp/sigterm.log"
check "the others go on at 2 ranks" grep -q "resized 3 -> 2 ranks after step" "$tmp/sigterm.log"

# A rank killed after a grow, with --max-restarts: the job (3 ranks since the
# grow) restarts at 2 from the last checkpoint, saved by 3 ranks.
timeout 180 $B/shardrun --nproc 2 --max-restarts=1 --port-file="$tmp/addr5" --job-id=killed -- \
  $B/shardopt_train "${train[@]}" --steps=600 --debug-slow-rank=0 --debug-slow-ms=20 \
  --ckpt-dir="$tmp/ck5" --ckpt-every=20 >"$tmp/killed.log" 2>&1 &
run=$!
check "fourth job starts" wait_file "$tmp/addr5" 60
addr5=$(cat "$tmp/addr5")
check "... trains past step 10" wait_until 60 "step 10" job_past_step "$addr5" 10
timeout 90 $B/shardctl --coordinator="$addr5" resize --ranks=3 --wait=60 >"$tmp/grow5.log" 2>&1
check "... grows to 3 ranks" test $? -eq 0
g=$(sed -n 's/^epoch 1 at step \([0-9]*\):.*/\1/p' "$tmp/grow5.log")
check "... trains on past step $((g + 30))" wait_until 60 "step $((g + 30))" job_past_step "$addr5" $((g + 30))
kill -9 "$(rank_pid killed 1)"
wait $run
check "the restarted job finishes (exit $?)" test $? -eq 0
check "restarted with the 2 ranks left of 3" \
  grep -q "lost rank 1; restart 1 of 1 with 2 ranks from the checkpoint of step" "$tmp/killed.log"
check "from a checkpoint the 3 ranks saved" \
  grep -q "(sharded, saved by 3 ranks)" "$tmp/killed.log"
c=$(sed -n 's/.*resumed from .*step-[0-9]* (sharded, saved by 3 ranks.*) at step \([0-9]*\),.*/\1/p' \
  "$tmp/killed.log" | head -n 1)
timeout 120 $B/shardrun --nproc 2 -- $B/shardopt_train "${train[@]}" --steps=600 \
  --resume="$tmp/ck5/step-$c" --ckpt-dir="$tmp/ref5" >"$tmp/ref5.log" 2>&1
check "reference: the checkpoint of step $c resumed at 2 ranks by hand" test $? -eq 0
$B/shardctl consolidate "$tmp/ck5/step-600" "$tmp/killed.st" >/dev/null 2>&1
$B/shardctl consolidate "$tmp/ref5/step-600" "$tmp/ref5.st" >/dev/null 2>&1
check "the restarted job's final state equals the by-hand resume's bit for bit" \
  cmp "$tmp/killed.st" "$tmp/ref5.st"

# shardrun --join: another shardrun adds 2 ranks to the running job.
timeout 180 $B/shardrun --nproc 2 --port-file="$tmp/addr6" --job-id=joined -- \
  $B/shardopt_train "${train[@]}" --steps=500 --debug-slow-rank=0 --debug-slow-ms=20 \
  >"$tmp/joined.log" 2>&1 &
run=$!
check "fifth job starts" wait_file "$tmp/addr6" 60
addr6=$(cat "$tmp/addr6")
check "... trains past step 20" wait_until 60 "step 20" job_past_step "$addr6" 20
timeout 120 $B/shardrun --join="$addr6" --nproc 2 -- $B/shardopt_train "${train[@]}" --steps=500 \
  >"$tmp/joiner.log" 2>&1
check "shardrun --join --nproc 2 runs its ranks to the end (exit $?)" test $? -eq 0
wait $run
check "... and the job's own shardrun finishes (exit $?)" test $? -eq 0
check "the joining shardrun says what it starts" \
  grep -q "shardrun: joining job joined at $addr6: starting ranks 2..3 of 4 (epoch 1)" "$tmp/joiner.log"
check "its ranks join the job" grep -q "rank 3 joined the job at step" "$tmp/joiner.log"
check "the job grew to 4 ranks" grep -q "resized 2 -> 4 ranks after step" "$tmp/joined.log"
check "the job's shardrun started no rank itself" test "$(grep -c "shardrun: starting rank" "$tmp/joined.log")" -eq 0
for bad in "--nproc 2 --max-nproc=1" "--nproc 2 --max-nproc=1025" "--nproc 1 --nnodes=2 --max-nproc=4"; do
  timeout 30 $B/shardrun $bad -- true >"$tmp/maxnproc.log" 2>&1
  check "shardrun $bad refused (exit $?)" test $? -eq 2
  check "... naming --max-nproc" grep -q -- "--max-nproc" "$tmp/maxnproc.log"
done
timeout 30 $B/shardrun --join=127.0.0.1:1 --nproc 1 --max-restarts=1 -- true >"$tmp/joinflags.log" 2>&1
check "--join with --max-restarts refused (exit $?)" test $? -eq 2
check "... saying why" grep -q -- "--max-restarts applies to the shardrun that runs the job" "$tmp/joinflags.log"

# Rank 0 drained, then a grow: the ranks that stayed stay (every notice
# carries only the newest resize's leaving ranks; they once took the grow for
# a second drain of theirs).
timeout 180 $B/shardrun --nproc 3 --port-file="$tmp/addr7" --job-id=drain0 -- \
  $B/shardopt_train "${train[@]}" --steps=1500 --debug-slow-rank=1 --debug-slow-ms=20 \
  >"$tmp/drain0.log" 2>&1 &
run=$!
check "drain-then-grow job starts" wait_file "$tmp/addr7" 60
addr7=$(cat "$tmp/addr7")
check "... trains past step 20" wait_until 60 "step 20" job_past_step "$addr7" 20
timeout 90 $B/shardctl --coordinator="$addr7" drain --rank=0 --wait=60 >"$tmp/drain0.out" 2>&1
check "rank 0 drained (exit $?)" test $? -eq 0
timeout 90 $B/shardctl --coordinator="$addr7" resize --ranks=3 --wait=60 >>"$tmp/drain0.out" 2>&1
check "then the job grows back to 3 ranks (exit $?)" test $? -eq 0
cat "$tmp/drain0.out"
wait $run
check "... and finishes (exit $?)" test $? -eq 0
check "only rank 0 left" test "$(grep -c "leaves the job after step" "$tmp/drain0.log")" -eq 1
check "the grow completed" grep -q "resized 2 -> 3 ranks after step" "$tmp/drain0.log"

# Refusals.
timeout 120 $B/shardrun --nproc 2 --max-nproc=3 --port-file="$tmp/addr2" --job-id=refuse -- \
  $B/shardopt_train --model=small --batch=64 --steps=100000 --log-every=1000 >"$tmp/refuse.log" 2>&1 &
run=$!
check "second job starts" wait_file "$tmp/addr2" 60
addr2=$(cat "$tmp/addr2")
check "... trains" wait_until 60 "step 5" job_past_step "$addr2" 5
refused() {  # refused NAME TEXT ARGS...
  local name=$1 text=$2
  shift 2
  timeout 30 $B/shardctl --coordinator="$addr2" "$@" >"$tmp/refused.log" 2>&1
  local rc=$?
  check "$name refused (exit $rc)" test $rc -ne 0
  check "$name: says $text" grep -q -- "$text" "$tmp/refused.log"
}
refused "resize to the same size" "the job has 2 ranks already" resize --ranks=2
refused "drain of rank 5" "the job has 2 ranks" drain --rank=5
refused "resize without --ranks" "usage: shardctl resize" resize
refused "--ranks=0" "--ranks" resize --ranks=0
# shardrun --max-nproc=3: no grow past 3 ranks (it would start that many
# processes here), and the job trains on.
refused "--ranks=4 past --max-nproc=3" "this job's shardrun starts at most 3 ranks on its node" \
  resize --ranks=4
refused "--ranks=100000" "ask for at most 3, or add ranks on another node with shardrun --join" \
  resize --ranks=100000
check "no rank was started for them" test "$(grep -c "shardrun: starting rank" "$tmp/refuse.log")" -eq 0
s0=$(job_step "$addr2")
check "the job trains on after the refusals" wait_until 60 "step $((s0 + 3))" job_past_step "$addr2" $((s0 + 3))
timeout 30 $B/shardctl --coordinator="$addr2" abort "done" >/dev/null 2>&1
wait $run

# A Python job whose optimizer is not elastic=True cannot resize live:
# refused with the reason (tests/e2e/python_resize_test.sh resizes one that is).
export PYTHONPATH=$PWD/python
timeout 120 $B/shardrun --nproc 2 --port-file="$tmp/addr4" --job-id=python -- \
  /usr/bin/python3 tests/python/launcher_job.py --steps=2000 --step-sleep=0.05 --out="$tmp/py.pt" \
  >"$tmp/python.log" 2>&1 &
run=$!
check "Python job starts" wait_file "$tmp/addr4" 60
addr2=$(cat "$tmp/addr4")
check "... trains" wait_until 60 "step 3" job_past_step "$addr2" 3
refused "resize of a Python job" "cannot resize live" resize --ranks=1
timeout 60 $B/shardrun --join="$addr2" --nproc 1 -- /usr/bin/python3 tests/python/launcher_job.py \
  --steps=10 --out="$tmp/py2.pt" >"$tmp/pyjoin.log" 2>&1
check "shardrun --join to that job refused (exit $?)" test $? -eq 1
check "... saying why" grep -q "cannot join the job at $addr2: resize: the job.s trainer cannot resize live" \
  "$tmp/pyjoin.log"
timeout 30 $B/shardctl --coordinator="$addr2" abort "done" >/dev/null 2>&1
wait $run

if [[ $fails -ne 0 ]]; then
  for f in "$tmp"/*.log; do echo "--- $f"; grep -v '^\(\[rank [0-9]*\] \)\?\[#' "$f" | tail -n 12; done
  exit 1
fi
