#!/usr/bin/env bash
# Live resize of a Python job (ShardedOptimizer(elastic=True), docs/elastic.md):
# tests/python/elastic_job.py under shardrun grows from 2 to 3 ranks
# (shardctl resize; shardrun starts the new rank, whose optimizer takes the
# job's state and step) and shrinks back to 2 (shardctl drain of a middle
# rank, which exits inside step() once the others hold its state), with
# on_resize rebuilding the data split. Its final parameters, BatchNorm
# buffers and optimizer state equal, bit for bit, those of runs that
# checkpointed at the same steps and resumed at the new size. Then a rank
# killed after a grow with --max-restarts: the job restarts at 2 ranks from
# the last checkpoint, saying how many steps were lost. And the refusals.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
B=tools
export PYTHONPATH=$PWD/python
job=tests/python/elastic_job.py
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT

steps=1200  # (every step sleeps 30 ms: >= 36 s, long enough for both resizes)
timeout 300 $B/shardrun --nproc 2 --port-file="$tmp/addr" --job-id=pyresize -- \
  /usr/bin/python3 $job --steps=$steps --step-sleep=0.03 --out="$tmp/live.pt" >"$tmp/run.log" 2>&1 &
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
timeout 90 $B/shardctl --coordinator="$addr" drain --rank=1 --wait=60 >"$tmp/drain.log" 2>&1
check "shardctl drain --rank=1 completes (exit $?)" test $? -eq 0
cat "$tmp/drain.log"
s2=$(sed -n 's/^epoch 2 at step \([0-9]*\): 3 -> 2 ranks (left: 1) in .*/\1/p' "$tmp/drain.log")
check "it says at which step rank 1 left ($s2)" test -n "$s2"
wait $run
check "the job finishes (exit $?)" test $? -eq 0
check "shardrun started rank 2 for the grow" \
  grep -q "shardrun: starting rank 2 to grow the job to 3 ranks (epoch 1)" "$tmp/run.log"
check "rank 2 joined at step $s1" \
  grep -q "rank 2 joined the job at step $s1 (epoch 1, 3 ranks)" "$tmp/run.log"
check "... and its script started there" grep -q "rank 2 of 3 starts at step $s1" "$tmp/run.log"
check "rank 0 says what the grow moved" \
  grep -q "resized 2 -> 3 ranks after step $s1 in [0-9.]* s (epoch 1; .*): moved" "$tmp/run.log"
check "on_resize ran on the ranks that stayed" \
  grep -q "on_resize: rank 1 -> 1 of 3 after step $s1 (epoch 1)" "$tmp/run.log"
check "rank 1 left after step $s2" grep -q "rank 1 left the job after step $s2" "$tmp/run.log"
check "rank 2 became rank 1 of 2" \
  grep -q "on_resize: rank 2 -> 1 of 2 after step $s2 (epoch 2)" "$tmp/run.log"

# The same by hand, through checkpoints: 2 ranks to s1, 3 ranks to s2, 2 to the end.
timeout 120 $B/shardrun --nproc 2 -- /usr/bin/python3 $job --steps=$s1 \
  --save-at-end="$tmp/ref" >"$tmp/ref1.log" 2>&1
check "reference: 2 ranks to step $s1" test $? -eq 0
timeout 120 $B/shardrun --nproc 3 -- /usr/bin/python3 $job --steps=$s2 \
  --resume="$tmp/ref/step-$s1" --save-at-end="$tmp/ref" >"$tmp/ref2.log" 2>&1
check "reference: resumed at 3 ranks to step $s2" test $? -eq 0
timeout 120 $B/shardrun --nproc 2 -- /usr/bin/python3 $job --steps=$steps \
  --resume="$tmp/ref/step-$s2" --out="$tmp/ref.pt" >"$tmp/ref3.log" 2>&1
check "reference: resumed at 2 ranks to the end" test $? -eq 0
/usr/bin/python3 tests/python/compare_states.py "$tmp/live.pt" "$tmp/ref.pt" >"$tmp/compare.log" 2>&1
check "parameters, buffers and optimizer state equal the checkpoint-and-resume runs' bit for bit" \
  test $? -eq 0
cat "$tmp/compare.log"

# A rank killed after a grow, with --max-restarts: the job (3 ranks since the
# grow) restarts at 2 from the last checkpoint, which 3 ranks saved.
timeout 240 $B/shardrun --nproc 2 --max-restarts=1 --port-file="$tmp/addr5" --job-id=pykilled -- \
  /usr/bin/python3 $job --steps=700 --step-sleep=0.03 --ckpt-dir="$tmp/ck5" --ckpt-every=20 \
  --out="$tmp/killed.pt" >"$tmp/killed.log" 2>&1 &
run=$!
check "second job starts" wait_file "$tmp/addr5" 60
addr5=$(cat "$tmp/addr5")
check "... trains past step 10" wait_until 60 "step 10" job_past_step "$addr5" 10
timeout 90 $B/shardctl --coordinator="$addr5" resize --ranks=3 --wait=60 >"$tmp/grow5.log" 2>&1
check "... grows to 3 ranks" test $? -eq 0
g=$(sed -n 's/^epoch 1 at step \([0-9]*\):.*/\1/p' "$tmp/grow5.log")
check "... trains on past step $((g + 30))" wait_until 60 "step $((g + 30))" job_past_step "$addr5" $((g + 30))
kill -9 "$(rank_pid pykilled 1 elastic_job.py)"
wait $run
check "the restarted job finishes (exit $?)" test $? -eq 0
check "restarted with the 2 ranks left of 3, saying the steps lost" \
  grep -q "lost rank 1; restart 1 of 1 with 2 ranks from the checkpoint of step [0-9]* (.* steps lost)" \
  "$tmp/killed.log"
check "the script resumed there with 2 ranks" \
  grep -q "restart 1: resumed at step [0-9]* with 2 ranks" "$tmp/killed.log"
c=$(sed -n 's/.*restart 1: resumed at step \([0-9]*\) with 2 ranks.*/\1/p' "$tmp/killed.log" | head -n 1)
timeout 120 $B/shardrun --nproc 2 -- /usr/bin/python3 $job --steps=700 --resume="$tmp/ck5/step-$c" \
  --out="$tmp/ref5.pt" >"$tmp/ref5.log" 2>&1
check "reference: the checkpoint of step $c resumed at 2 ranks by hand" test $? -eq 0
/usr/bin/python3 tests/python/compare_states.py "$tmp/killed.pt" "$tmp/ref5.pt" >"$tmp/compare5.log" 2>&1
check "the restarted job's final state equals the by-hand resume's bit for bit" test $? -eq 0

# shardrun --join: another shardrun adds a rank running the same script.
timeout 180 $B/shardrun --nproc 2 --port-file="$tmp/addr6" --job-id=pyjoined -- \
  /usr/bin/python3 $job --steps=500 --step-sleep=0.03 >"$tmp/joined.log" 2>&1 &
run=$!
check "fourth job starts" wait_file "$tmp/addr6" 60
addr6=$(cat "$tmp/addr6")
check "... trains past step 20" wait_until 60 "step 20" job_past_step "$addr6" 20
timeout 120 $B/shardrun --join="$addr6" --nproc 1 -- /usr/bin/python3 $job --steps=500 \
  --step-sleep=0.03 >"$tmp/joiner.log" 2>&1
check "shardrun --join runs its rank to the end (exit $?)" test $? -eq 0
wait $run
check "... and the job's own shardrun finishes (exit $?)" test $? -eq 0
check "the joined rank took the job's state" grep -q "rank 2 joined the job at step" "$tmp/joiner.log"
check "the job grew to 3 ranks" grep -q "resized 2 -> 3 ranks after step" "$tmp/joined.log"

# A checkpoint every step: the grow lands on a save. The ranks that were
# there skip that one save (the new rank starts with the next step and never
# makes the call), saying so, instead of a collective the new rank is not in.
timeout 180 $B/shardrun --nproc 2 --port-file="$tmp/addr8" --job-id=pyevery -- \
  /usr/bin/python3 $job --steps=300 --step-sleep=0.03 --ckpt-dir="$tmp/ck8" --ckpt-every=1 \
  >"$tmp/every.log" 2>&1 &
run=$!
check "fifth job starts" wait_file "$tmp/addr8" 60
check "... trains past step 20" wait_until 60 "step 20" job_past_step "$(cat "$tmp/addr8")" 20
timeout 90 $B/shardctl --coordinator="$(cat "$tmp/addr8")" resize --ranks=3 --wait=60 >/dev/null 2>&1
check "... grows to 3 ranks (exit $?)" test $? -eq 0
wait $run
check "a job that saves every step finishes after a grow (exit $?)" test $? -eq 0
check "... saying which save it skipped" \
  grep -q "save_checkpoint after step [0-9]* skipped: the job grew to 3 ranks" "$tmp/every.log"
check "... and saved the last step with 3 ranks" test -f "$tmp/ck8/step-300/manifest.json"

# opt.drain() from a SIGTERM handler: rank 1 of 3 leaves, the job goes on at 2.
timeout 180 $B/shardrun --nproc 3 --port-file="$tmp/addr3" --job-id=pysigterm -- \
  /usr/bin/python3 $job --steps=500 --step-sleep=0.03 --drain-on-sigterm >"$tmp/sigterm.log" 2>&1 &
run=$!
check "third job starts" wait_file "$tmp/addr3" 60
check "... trains past step 20" wait_until 60 "step 20" job_past_step "$(cat "$tmp/addr3")" 20
kill -TERM "$(rank_pid pysigterm 1 elastic_job.py)"
wait $run
check "after SIGTERM to rank 1 the job finishes (exit $?)" test $? -eq 0
check "rank 1 says it drains" grep -q "rank 1 leaves the job at the next step boundary" "$tmp/sigterm.log"
check "... and leaves" grep -q "rank 1 left the job after step" "$tmp/sigterm.log"
check "the others go on at 2 ranks" grep -q "resized 3 -> 2 ranks after step" "$tmp/sigterm.log"

# Refusals: elastic=True without shardrun; with a class whose state lives in Python.
/usr/bin/python3 -c 'import torch, shardopt
shardopt.ShardedOptimizer(torch.nn.Linear(2, 2).named_parameters(), elastic=True)' \
  >"$tmp/single.log" 2>&1
check "elastic=True without shardrun refused (exit $?)" test $? -ne 0
check "... saying it needs a coordinator" grep -q "elastic=True needs a shardopt coordinator" "$tmp/single.log"
timeout 60 $B/shardrun --nproc 1 -- /usr/bin/python3 -c 'import torch, shardopt
shardopt.init()
shardopt.ShardedOptimizer(torch.nn.Linear(2, 2).named_parameters(), torch.optim.RMSprop, elastic=True)' \
  >"$tmp/rmsprop.log" 2>&1
check "elastic=True with RMSprop refused (exit $?)" test $? -ne 0
check "... saying why" grep -q "RMSprop's state lives in Python" "$tmp/rmsprop.log"

# shardrun --replicate-shards: a Python job runs, and rank 0 says once that
# Python ranks keep no replicas (instead of a silent no-op).
timeout 60 $B/shardrun --nproc 2 --replicate-shards=5 -- /usr/bin/python3 -c 'import torch, shardopt
shardopt.init()
shardopt.ShardedOptimizer(torch.nn.Linear(2, 2).named_parameters())' >"$tmp/replicas.log" 2>&1
check "a Python job under --replicate-shards runs (exit $?)" test $? -eq 0
check "... and rank 0 says it keeps no replicas" \
  test "$(grep -c "Python ranks keep no in-memory replicas" "$tmp/replicas.log")" -eq 1

if [[ $fails -ne 0 ]]; then
  for f in "$tmp"/*.log; do echo "--- $f"; tail -n 15 "$f"; done
  exit 1
fi
