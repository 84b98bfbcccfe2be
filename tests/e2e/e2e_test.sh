#!/usr/bin/env bash
# End to end: shardrun + shardopt_train + shardctl as a user runs them.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
B=tools
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT

# 1. A 2-rank job runs to completion with prefixed output.
timeout 120 $B/shardrun --nproc 2 -- $B/shardopt_train --model=tiny --steps=5 >"$tmp/ok.log" 2>&1
rc=$?
check "job completes" test $rc -eq 0
check "output prefixed by rank" grep -q '^\[rank 0\] \[####################\] step 5/5' "$tmp/ok.log"
check "shardrun reports success" grep -q 'shardrun: all 2 ranks finished' "$tmp/ok.log"
check "auto transport is shared memory on one host" grep -q 'shardopt_train: transport shm (auto: every rank on this host)' "$tmp/ok.log"
timeout 120 $B/shardrun --nproc 2 -- $B/shardopt_train --model=tiny --steps=3 --transport=gloo >"$tmp/gloo.log" 2>&1
check "--transport=gloo runs over Gloo" grep -q 'shardopt_train: transport gloo$' "$tmp/gloo.log"
check "--transport=gloo completes" grep -q 'shardrun: all 2 ranks finished' "$tmp/gloo.log"

# 2. A failing rank stops the job within seconds, with a one-line reason.
cat >"$tmp/flaky.sh" <<SH
#!/usr/bin/env bash
if [[ \$RANK == 1 ]]; then echo "rank 1 gives up"; exit 3; fi
exec $PWD/$B/shardopt_train --model=tiny --steps=5
SH
chmod +x "$tmp/flaky.sh"
start=$(date +%s)
timeout 60 $B/shardrun --nproc 2 -- "$tmp/flaky.sh" >"$tmp/fail.log" 2>&1
rc=$?
took=$(( $(date +%s) - start ))
check "failed job exits non-zero" test $rc -eq 1
check "reason names the rank" grep -q 'shardrun: job failed: rank 1 exited with status 3' "$tmp/fail.log"
check "stopped within seconds ($took s)" test $took -le 20

# 3. Query a running job, change its learning rate, take a checkpoint, abort it with shardctl.
echo "sesame" >"$tmp/token"
timeout 120 $B/shardrun --nproc 2 --port-file "$tmp/addr" --token-file "$tmp/token" -- \
  $B/shardopt_train --model=small --steps=1000000 --log-every=100000 --ckpt-dir="$tmp/ondemand" \
  >"$tmp/run.log" 2>&1 &
run=$!
wait_file "$tmp/addr" 20
addr=$(cat "$tmp/addr")
ctl() { timeout 30 $B/shardctl --coordinator="$addr" --token-file="$tmp/token" "$@"; }
ctl status --wait=60 >"$tmp/status.txt"
check "status shows running" grep -q 'running, 2 ranks' "$tmp/status.txt"
ctl layout >"$tmp/layout.txt"
check "layout lists buckets and ranks" grep -q 'owned per rank: 0:' "$tmp/layout.txt"
ctl layout --json >"$tmp/layout.json"
check "layout json" python3 -c "import json,sys; d=json.load(open('$tmp/layout.json')); assert d['worldSize']==2"
# The advisor on the live job's model (the layout names every parameter and its shape).
timeout 30 $B/shardctl plan --model="$tmp/layout.json" --world=2,4 --forward-ms=10 --backward-ms=20 \
  --json >"$tmp/plan.json"
check "plan reads the live job's layout" python3 -c "
import json, math
d = json.load(open('$tmp/layout.json')); p = json.load(open('$tmp/plan.json'))
n = sum(math.prod(int(x) for x in q['shape']) for q in d['params'] if q.get('trainable'))
assert n > 0 and [r['world_size'] for r in p] == [2, 4], p
assert p[0]['parameters'] == n, (p[0]['parameters'], n)
assert p[0]['tensors'] == len([q for q in d['params'] if q.get('trainable')]), p[0]"
ctl memory >"$tmp/memory.txt"
check "memory per rank" grep -q '^total' "$tmp/memory.txt"
check "health" test "$(ctl health)" = "SERVING"
ctl set-lr 0.5 >/dev/null
check "set-lr accepted" test $? -eq 0
timeout 30 $B/shardctl --coordinator="$addr" status >"$tmp/noauth.txt" 2>&1
check "missing token refused" grep -q 'missing bearer token' "$tmp/noauth.txt"
wait_until 15 "the ranks to log lr 0.5" grep -q 'learning rate set to 0.5' "$tmp/run.log"
ctl checkpoint >/dev/null
check "on-demand checkpoint taken" wait_until 15 "the on-demand checkpoint in the log" \
  grep -q "checkpoint $tmp/ondemand/step-.* written" "$tmp/run.log"
check "on-demand checkpoint verifies" bash -c "$B/shardctl inspect '$tmp/ondemand' | grep 'every CRC matches' >/dev/null"
ctl abort "test says stop" >/dev/null
wait $run
rc=$?
check "aborted job exits non-zero" test $rc -eq 1
check "abort reason reported" grep -q 'job failed: test says stop' "$tmp/run.log"
check "lr change applied" grep -q 'learning rate set to 0.5' "$tmp/run.log"

# 3a. Gradient sharding (ZeRO-2): shardctl memory shows each rank holding its half of the
# gradients plus the staging, all counted: room for two 4096-element buckets of the other
# rank's chunk. The tiny model's weights (its 256x256 one is 72% of it) are larger than
# that and are reduced in pieces of a bucket's share, so 0.5 + 0.05 here (README).
grad_ratio() {  # grad_ratio MEMORY_JSON -> max over ranks of gradient / parameter bytes
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['ranks']; print(max(int(x['gradBytes'])/int(x['paramBytes']) for x in r))" "$1"
}
for mode in off on; do
  timeout 120 $B/shardrun --nproc 2 --port-file "$tmp/addr.$mode" --token-file "$tmp/token" \
    --job-id="zero2-$mode" -- $B/shardopt_train --model=tiny --steps=1000000 --log-every=100000 \
    --bucket-cap=4096 --shard-gradients=$mode >"$tmp/zero2.$mode.log" 2>&1 &
  run=$!
  wait_file "$tmp/addr.$mode" 20
  addr=$(cat "$tmp/addr.$mode")
  ctl status --wait=60 >/dev/null
  # A few steps: staging buffers allocated.
  wait_until 30 "job zero2-$mode past step 2" job_past_step "$addr" 2 --token-file="$tmp/token"
  ctl memory --json >"$tmp/memory.$mode.json"
  ctl layout --json >"$tmp/layout.$mode.json"
  ctl memory >"$tmp/memory.$mode.txt"
  ctl abort "zero2 check done" >/dev/null
  wait $run
done
full=$(grad_ratio "$tmp/memory.off.json")
sharded=$(grad_ratio "$tmp/memory.on.json")
echo "gradient bytes / parameter bytes per rank: full $full, --shard-gradients=on $sharded"
check "full gradients: one per parameter" python3 -c "assert abs($full - 1.0) < 1e-9"
# What the staging rule gives for this layout (ShardedOptimizer::PrepareShardedGradients):
# a piece is a 4096-element bucket's share per rank, rounded up to the 64-element alignment;
# a bucket of one tensor larger than a piece stages one piece.
expected=$(python3 -c "
import json,sys
l=json.load(open(sys.argv[1]))
caps=[int(c) for c in l['bucketCapacity']]
names={}
for r in l['ranges']:
    names.setdefault(int(r.get('bucket',0)),set()).update(p.split('[')[0] for p in r.get('params',[]))
piece=((4096+2*64+1)//2+63)//64*64
stages=sorted((piece if len(names.get(b,()))==1 and c>piece else c for b,c in enumerate(caps)), reverse=True)
staging=max(stages[0], min(stages[0]+(stages[1] if len(stages)>1 else 0), 2*piece))
print(0.5+staging/(2*sum(caps)))" "$tmp/layout.on.json")
echo "expected with sharding: $expected"
check "sharded gradients: half plus the staging" python3 -c "assert abs($sharded - $expected) < 1e-6 and $sharded < 0.56"

# 3b. Ctrl-C (SIGINT to shardrun) stops everything cleanly, once it trains.
$B/shardrun --nproc 2 --job-id=ctrlc --port-file "$tmp/addrc" -- $B/shardopt_train --model=small \
  --steps=1000000 --log-every=100000 >"$tmp/ctrlc.log" 2>&1 &
run=$!
wait_until 10 "rank 0 of job ctrlc to start" grep -q 'shardopt_train: 2 ranks' "$tmp/ctrlc.log"
wait_file "$tmp/addrc" 20
wait_until 60 "job ctrlc past step 0" job_past_step "$(cat "$tmp/addrc")" 0
kill -INT $run
start=$(date +%s)
wait $run
rc=$?
check "Ctrl-C: exit status 130" test $rc -eq 130
check "Ctrl-C: one-line reason" grep -q 'shardrun: job failed: interrupted (signal 2); stopped all ranks' "$tmp/ctrlc.log"
check "Ctrl-C: stopped within 10 s" test $(( $(date +%s) - start )) -le 10
check "Ctrl-C: no rank left" test -z "$(pgrep -f 'SHARDOPT_JOB_ID=ctrlc' || true)$(for p in $(pgrep -f shardopt_train); do tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -x SHARDOPT_JOB_ID=ctrlc >/dev/null && echo $p; done)"

# 4. kill -9 one rank of a 3-rank job: the others exit naming it, shardrun fails, no hang.
timeout 120 $B/shardrun --nproc 3 --job-id=kill9 --heartbeat-timeout=3 --port-file "$tmp/addr9" -- \
  $B/shardopt_train --model=small --steps=1000000 --log-every=100000 >"$tmp/kill.log" 2>&1 &
run=$!
wait_file "$tmp/addr9" 20
timeout 60 $B/shardctl --coordinator="$(cat "$tmp/addr9")" status --wait=60 >/dev/null
victim=$(rank_pid kill9 1)
start=$(date +%s)
kill -9 "$victim"
wait $run
rc=$?
took=$(( $(date +%s) - start ))
check "kill -9: shardrun exits non-zero" test $rc -eq 1
check "kill -9: reason names the rank" grep -q 'job failed: rank 1 was killed by signal 9' "$tmp/kill.log"
check "kill -9: survivors name the dead rank" grep -q '^\[rank [02]\] .*failed: .*rank 1 was killed by signal 9' "$tmp/kill.log"
check "kill -9: over within heartbeat timeout + 5 s ($took s)" test $took -le 8
check "kill -9: no rank left behind" test -z "$(rank_pid kill9 0)$(rank_pid kill9 2)"

# 5. kill -9 the launcher (and its coordinator): every rank stops, none hangs.
$B/shardrun --nproc 2 --job-id=killrun --port-file "$tmp/addrk" -- \
  $B/shardopt_train --model=small --steps=1000000 --log-every=100000 >"$tmp/killrun.log" 2>&1 &
run=$!
wait_file "$tmp/addrk" 20
timeout 60 $B/shardctl --coordinator="$(cat "$tmp/addrk")" status --wait=60 >/dev/null
kill -9 $run
wait $run 2>/dev/null
check "launcher killed: ranks stop within 10 s" wait_until 10 "the ranks of job killrun to exit" \
  no_ranks killrun 0 1

# 5b. A rank that stalls in collectives while still heartbeating: the job aborts naming it.
timeout 120 $B/shardrun --nproc 3 -- $B/shardopt_train --model=small --steps=100 --collective-timeout=3 \
  --debug-stall-rank=2 --debug-stall-step=5 >"$tmp/stall.log" 2>&1
rc=$?
check "stalled rank: job fails" test $rc -eq 1
check "stalled rank: named" grep -q 'stalled rank(s): 2 (at step 5)' "$tmp/stall.log"

# 6. Checkpoints: save every K steps with 2 ranks, resume with 3, list, inspect, consolidate.
timeout 120 $B/shardrun --nproc 2 -- $B/shardopt_train --model=tiny --steps=6 --ckpt-dir="$tmp/ck" \
  --ckpt-every=3 >"$tmp/ck1.log" 2>&1
check "training with checkpoints" test $? -eq 0
check "checkpoint written" grep -q "checkpoint $tmp/ck/step-3 written" "$tmp/ck1.log"
timeout 120 $B/shardrun --nproc 3 -- $B/shardopt_train --model=tiny --steps=9 --batch=8 --resume="$tmp/ck" --ckpt-dir="$tmp/ck" \
  >"$tmp/ck2.log" 2>&1
check "resume with 3 ranks" grep -q 'resumed from .* (sharded, saved by 2 ranks) at step 6, lr 0.0001 as saved' "$tmp/ck2.log"
check "resumed job finishes" grep -q 'step 9/9' "$tmp/ck2.log"
$B/shardctl checkpoints "$tmp/ck" >"$tmp/list.txt"
check "checkpoints listed" grep -q 'step-9 .* 3 .*complete, LATEST' "$tmp/list.txt"
$B/shardctl inspect "$tmp/ck" >"$tmp/inspect.txt"
check "inspect verifies" grep -q 'verify: every CRC matches' "$tmp/inspect.txt"
$B/shardctl consolidate "$tmp/ck/step-6" "$tmp/whole.safetensors" >/dev/null 2>&1
check "consolidate" test -s "$tmp/whole.safetensors"
printf 'x' | dd of="$tmp/ck/step-9/shard-1-of-3.safetensors" bs=1 seek=200 conv=notrunc 2>/dev/null
$B/shardctl inspect "$tmp/ck" >"$tmp/inspect2.txt" 2>&1
check "inspect finds a flipped byte" grep -q 'shard-1-of-3.safetensors.*CRC32C' "$tmp/inspect2.txt"

# 7. Clear errors.
out=$($B/shardctl --coordinator=127.0.0.1:1 status 2>&1)
check "unreachable is one line" test "$(echo "$out" | wc -l)" -eq 1
check "unreachable says so" grep -q 'cannot reach the coordinator' <<<"$out"
check "shardrun --help" bash -c "$B/shardrun --help | grep 'usage: shardrun' >/dev/null"
check "trainer --help" bash -c "$B/shardopt_train --help | grep 'usage: shardopt_train' >/dev/null"
$B/shardrun --nproc 0 -- true 2>"$tmp/bad.txt"
check "bad --nproc refused" grep -q 'nproc must be' "$tmp/bad.txt"

if [[ $fails -ne 0 ]]; then
  echo "---- logs"; tail -n 20 "$tmp"/*.log
  exit 1
fi
