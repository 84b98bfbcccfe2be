#!/usr/bin/env bash
# Bad values must not kill or poison a run (issue 12): shardopt_train, shardrun
# and shardctl refuse every malformed or out-of-range flag by name, within
# seconds, with exit status 2; a run that goes non-finite stops, naming the
# step, and fails (never exit 0 after training NaN). Every process runs under
# a timeout; everything listens on 127.0.0.1, port 0.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
B=tools
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT

# refused NAME TEXT CMD...: CMD exits with status 2 within 15 s, and the last
# line of its stderr (the one-line reason) contains TEXT (the flag's name).
refused() {
  local name=$1 text=$2; shift 2
  local start rc took last
  start=$(date +%s)
  timeout 30 "$@" >"$tmp/out" 2>"$tmp/err" </dev/null
  rc=$?
  took=$(( $(date +%s) - start ))
  last=$(tail -n 1 "$tmp/err")
  if [[ $rc -eq 2 && $took -le 15 ]] && grep -qF -- "$text" <<<"$last"; then
    echo "PASS $name: $last"
  else
    echo "FAIL $name: exit $rc after ${took}s; stderr: $(head -c 600 "$tmp/err"); stdout: $(head -c 300 "$tmp/out")"
    fails=$((fails + 1))
  fi
}

# --- shardopt_train, one rank (WORLD_SIZE=1), no coordinator needed to refuse flags.
train() {  # train NAME TEXT FLAGS...
  local name=$1 text=$2; shift 2
  refused "shardopt_train $name" "$text" env -u SHARDOPT_COORDINATOR WORLD_SIZE=1 RANK=0 \
    $B/shardopt_train --model=tiny "$@"
}
train "--log-every=0" "--log-every must be an integer in [1, " --log-every=0
train "--advise=maybe" "--advise" --advise=maybe
train "--log-every=abc" "--log-every" --log-every=abc
train "--ckpt-every=abc" "--ckpt-every" --ckpt-dir="$tmp/ck" --ckpt-every=abc
train "--ckpt-keep=abc" "--ckpt-keep" --ckpt-dir="$tmp/ck" --ckpt-keep=abc
train "--ckpt-every without --ckpt-dir" "--ckpt-every" --ckpt-every=2
train "--collective-timeout=abc" "--collective-timeout" --collective-timeout=abc
train "--collective-timeout=nan" "--collective-timeout" --collective-timeout=nan
train "--collective-timeout=0" "--collective-timeout" --collective-timeout=0
train "--batch=1e11" "--batch" --batch=1e11
train "--batch=100000000000" "--batch" --batch=100000000000
train "--lr=1e39" "--lr" --lr=1e39
train "--lr=nan" "--lr" --lr=nan
train "--lr=-1e-4" "--lr" --lr=-1e-4
# (lr=0 and values that are 0 as a float are valid learning rates, as in
# torch.optim: the one rule of common/hyper_params.h, tested with its table
# in hyper_params_test and hyper_params_paths_test.)
train "--steps=0" "--steps" --steps=0
train "--steps= (empty)" "--steps" --steps=
train "--steps without a value" "--steps needs a value" --steps
train "--steps twice" "--steps given twice" --steps=3 --steps=4
train "--threads=100000" "--threads" --threads=100000
train "--bucket-cap=0" "--bucket-cap" --bucket-cap=0
train "--clip=inf" "--clip" --clip=inf
train "--clip=-1" "--clip" --clip=-1
train "--optimizer=adagrad" "--optimizer" --optimizer=adagrad
refused "shardopt_train --model=huge" "--model must be one of" env -u SHARDOPT_COORDINATOR WORLD_SIZE=1 RANK=0 \
  $B/shardopt_train --model=huge
train "--ckpt-dir= (empty)" "--ckpt-dir" --ckpt-dir=
train "--resume= (empty)" "--resume" --resume=
train "--malloc=fast" "--malloc" --malloc=fast
train "--debug-stall-rank=1 of 1 rank" "--debug-stall-rank" --debug-stall-rank=1
train "--debug-nan-step=x" "--debug-nan-step" --debug-nan-step=x
train "unknown flag" "--bogus" --bogus=1
train "stray argument" "'steps=5'" steps=5
refused "shardopt_train WORLD_SIZE=abc" "WORLD_SIZE" env -u SHARDOPT_COORDINATOR WORLD_SIZE=abc RANK=0 \
  $B/shardopt_train --model=tiny
refused "shardopt_train WORLD_SIZE=2147483648" "WORLD_SIZE" env -u SHARDOPT_COORDINATOR WORLD_SIZE=2147483648 \
  RANK=0 $B/shardopt_train --model=tiny
refused "shardopt_train RANK=1 of 1" "RANK" env -u SHARDOPT_COORDINATOR WORLD_SIZE=1 RANK=1 \
  $B/shardopt_train --model=tiny

# --- shardrun (the program would be `true`; nothing may start).
run() {  # run NAME TEXT FLAGS...
  local name=$1 text=$2; shift 2
  refused "shardrun $name" "$text" $B/shardrun "$@" -- true
}
run "--port 70000" "--port must be a port number in [0, 65535], got '70000'" --nproc 1 --port 70000
run "--port=-1" "--port" --nproc=1 --port=-1
run "--nnodes=2147483648" "--nnodes" --nproc=1 --nnodes=2147483648
run "--heartbeat-timeout=nan" "--heartbeat-timeout" --nproc=1 --heartbeat-timeout=nan
run "--heartbeat-timeout=abc" "--heartbeat-timeout" --nproc=1 --heartbeat-timeout=abc
run "--heartbeat-timeout=0" "--heartbeat-timeout" --nproc=1 --heartbeat-timeout=0
run "--nproc=0" "--nproc" --nproc=0
run "--nproc=abc" "--nproc" --nproc=abc
run "--nproc=1e3" "--nproc" --nproc=1e3
run "--nproc=2000" "--nproc" --nproc=2000
run "no --nproc" "--nproc is required"
run "--nproc twice" "--nproc given twice" --nproc=1 --nproc=2
run "--node-rank=2 of 2" "--node-rank" --nproc=1 --nnodes=2 --node-rank=2
run "--port-file= (empty)" "--port-file" --nproc=1 --port-file=
run "--job-id= (empty)" "--job-id" --nproc=1 --job-id=
refused "shardrun stray argument" "unexpected argument 'true'" $B/shardrun --nproc=1 true

# --- shardctl (port 0: nothing is ever contacted; flags are refused before any RPC).
ctl() {  # ctl NAME TEXT ARGS...
  local name=$1 text=$2; shift 2
  refused "shardctl $name" "$text" $B/shardctl --coordinator=127.0.0.1:0 "$@"
}
ctl "--wait=nan" "--wait" status --wait=nan
ctl "--wait=abc" "--wait" status --wait=abc
ctl "--wait=-1" "--wait" status --wait=-1
ctl "--wait=abc on another command" "--wait" layout --wait=abc
ctl "--rate=0" "--rate" load --rate=0
ctl "--rate=inf" "--rate" load --rate=inf
ctl "--duration=nan" "--duration" load --duration=nan
ctl "--json=maybe" "--json" status --json=maybe
ctl "--format=zip" "--format" consolidate a b --format=zip
ctl "--optimizer=adagrad" "--optimizer" import a b --optimizer=adagrad
ctl "--wait twice" "--wait given twice" status --wait=1 --wait=2
ctl "unknown flag" "--bogus" status --bogus
ctl "set-lr 1e39" "set-lr" set-lr 1e39
ctl "set-lr nan" "set-lr" set-lr nan
ctl "set-lr abc" "set-lr" set-lr abc
ctl "status with an argument" "status takes no argument" status extra
refused "shardctl --coordinator= (empty)" "--coordinator" $B/shardctl --coordinator= status

# --- Valid flags still train (a flag given twice with the same value is fine).
timeout 120 $B/shardrun --nproc 1 -- $B/shardopt_train --model=tiny --steps=3 --steps=3 --log-every=1 \
  --lr=1e-3 --collective-timeout=30 --ckpt-dir="$tmp/good" --ckpt-every=2 --ckpt-keep=1 >"$tmp/good.log" 2>&1
check "valid flags: job completes" test $? -eq 0
check "valid flags: trains to the end" grep -q 'step 3/3' "$tmp/good.log"
check "valid flags: checkpoints" test -f "$tmp/good/step-3/manifest.json"

# --- A run that goes non-finite (a huge but finite lr passes validation) stops
# at the first bad step, names it, writes no checkpoint of the poisoned state,
# and fails.
nonfinite() {  # nonfinite NPROC
  local n=$1 log="$tmp/nf$1.log" start rc took step
  start=$(date +%s)
  timeout 120 $B/shardrun --nproc "$n" -- $B/shardopt_train --model=tiny --steps=50 --lr=1e30 \
    --optimizer=sgd --log-every=1 --ckpt-dir="$tmp/nf$n" --ckpt-every=1 >"$log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  check "non-finite, $n rank(s): exits 1 (not 0, not a timeout)" test $rc -eq 1
  check "non-finite, $n rank(s): over within 60 s ($took s)" test $took -le 60
  # Every rank names the step: the one that saw it first, and any other that
  # was stopped by its report before seeing it itself ("job aborted: rank 1:
  # non-finite ...").
  for r in $(seq 0 $((n - 1))); do
    check "non-finite, $n rank(s): rank $r names the step" \
      grep -qE "^\[rank $r\] shardopt_train\[rank $r\]: .*non-finite (loss|gradient norm) \((nan|-?inf)\) at step [0-9]+" "$log"
  done
  check "non-finite, $n rank(s): shardrun gives the reason" \
    grep -qE 'shardrun: job failed: rank [0-9]+: non-finite .* at step [0-9]+' "$log"
  check "non-finite, $n rank(s): never reports done" bash -c "! grep -q 'done:' '$log'"
  step=$(grep -oE 'non-finite [a-z ]+ \([^)]*\) at step [0-9]+' "$log" | sed -n 1p | grep -oE '[0-9]+$')
  if [[ -n "$step" ]]; then
    local poisoned=0
    for d in "$tmp/nf$n"/step-*; do
      [[ -e "$d" ]] || continue
      [[ ${d##*/step-} -ge $step ]] && poisoned=1
    done
    check "non-finite, $n rank(s): no checkpoint at or after step $step" test $poisoned -eq 0
  fi
}
nonfinite 1
nonfinite 2

# --- A loss that is non-finite on one rank only (its gradients stay finite:
# --debug-nan-rank) stops every rank at that step rather than leaving the
# others to hang.
start=$(date +%s)
timeout 120 $B/shardrun --nproc 2 -- $B/shardopt_train --model=tiny --steps=10 --log-every=1 \
  --debug-nan-rank=1 --debug-nan-step=3 --ckpt-dir="$tmp/nanr" --ckpt-every=1 >"$tmp/nanrank.log" 2>&1
rc=$?
took=$(( $(date +%s) - start ))
check "nan on one rank: job exits 1" test $rc -eq 1
check "nan on one rank: over within 60 s ($took s)" test $took -le 60
# Which rank reports first is a race: rank 1 names its own loss, or learns of
# it from rank 0's abort first; either way it stops at step 3 naming rank 1.
check "nan on one rank: that rank stops at the step, named" \
  grep -qE '^\[rank 1\] shardopt_train\[rank 1\]: (non-finite loss \(nan\)|.*rank 1 had a non-finite loss) at step 3; stopping' \
  "$tmp/nanrank.log"
check "nan on one rank: the other stops at the same step" \
  grep -qE '^\[rank 0\] shardopt_train\[rank 0\]: .*rank 1(: non-finite loss \(nan\)| had a non-finite loss) at step 3; stopping' \
  "$tmp/nanrank.log"
check "nan on one rank: checkpoints up to step 2 only" \
  bash -c "test -d '$tmp/nanr/step-2' && ! test -e '$tmp/nanr/step-3'"

# --advise: the partition advisor's two lines for the live run, from rank 0 only.
timeout 120 $B/shardrun --nproc 2 -- $B/shardopt_train --model=tiny --steps=6 --advise \
  >"$tmp/advise.log" 2>&1
check "--advise: the run succeeds" test $? -eq 0
check "--advise: rank 0 prints the prediction for this run" \
  grep -qE '^\[rank 0\] advisor: this run \(shardopt_overlap\) [0-9.]+ ms/step predicted, .*DDP [0-9.]+ ms .*link measured' \
  "$tmp/advise.log"
check "--advise: and the recommendation" \
  grep -qE '^\[rank 0\] advisor: recommended shardopt_(overlap|zero2), buckets of [0-9]+ MiB' "$tmp/advise.log"
check "--advise: rank 1 prints nothing of it" bash -c "! grep -q '^\[rank 1\] advisor' '$tmp/advise.log'"

if [[ $fails -ne 0 ]]; then
  echo "---- logs"; tail -n 20 "$tmp"/*.log
  exit 1
fi
echo "all passed"
