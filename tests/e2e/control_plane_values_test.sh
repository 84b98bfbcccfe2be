#!/usr/bin/env bash
# Issue 12, end to end with shardrun, shardopt_train and shardctl:
# 1. set-lr refuses what the kernels cannot use (1e39 is inf as a float, nan,
#    inf, -1, 0, 1e-46 is 0 as a float): exit 2, a clear message, the job
#    keeps training; 1e-3 is applied by every rank.
# 2. status shows the learning rate the ranks train with (it said "lr 0").
# 3. A KvGet left waiting 10 minutes (a Python grpcio client) does not keep
#    shardrun alive after the job finished: it gets UNAVAILABLE "coordinator
#    shutting down" as shardrun exits.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT

# 1 and 2: a long job at --lr=1e-4.
timeout 180 tools/shardrun --nproc 2 --port-file "$tmp/addr" -- \
  tools/shardopt_train --model=small --steps=1000000 --log-every=100000 --lr=1e-4 \
  >"$tmp/run.log" 2>&1 &
run=$!
wait_file "$tmp/addr" 20
addr=$(cat "$tmp/addr")
ctl() { timeout 30 tools/shardctl --coordinator="$addr" "$@"; }
ctl status --wait=60 >"$tmp/status.txt"
check "status shows the ranks' lr, not 0" grep -q 'running, 2 ranks, step [0-9]*, lr 0.0001,' "$tmp/status.txt"
for v in 1e39 nan inf -1 0 1e-46; do
  ctl set-lr "$v" >"$tmp/setlr.out" 2>"$tmp/setlr.err"
  rc=$?
  check "set-lr $v refused (exit $rc)" test $rc -eq 2
  # shardctl refuses what it can tell itself; the coordinator refuses the
  # rest (tests/integration/coordinator_test.cc sends these values over gRPC).
  check "set-lr $v: says why" grep -q "shardctl: set-lr: invalid lr" "$tmp/setlr.err"
done
ctl status >"$tmp/status2.txt"
check "job still running after refusals" grep -q 'running, 2 ranks' "$tmp/status2.txt"
check "nothing was requested" grep -q ', lr 0.0001,' "$tmp/status2.txt"
ctl set-lr 1e-3 >/dev/null
check "set-lr 1e-3 accepted" test $? -eq 0
check "1e-3 applied" wait_until 30 "the ranks to log lr 0.001" grep -q 'learning rate set to 0.001 ' "$tmp/run.log"
check "status shows the applied lr" wait_until 30 "shardctl status to show lr 0.001" \
  bash -c "timeout 30 tools/shardctl --coordinator='$addr' status | grep ', lr 0.001,' >/dev/null"
check "no rank saw a bad lr" bash -c "! grep -q -i 'invalid learning rate' '$tmp/run.log'"
ctl abort "test over" >/dev/null
wait $run

# 3: a job that finishes while a KvGet waits for a key nobody sets.
if ! /usr/bin/python3 -c "import grpc, google.protobuf" 2>/dev/null; then
  echo "FAIL: python3-grpcio / python3-protobuf missing (tools/setup.sh installs them)"
  exit 1
fi
protoc -Iproto --python_out="$tmp" --grpc_out="$tmp" \
  --plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin proto/shardopt.proto || exit 1
cat >"$tmp/kvget.py" <<'PY'
import sys, time
sys.path.insert(0, sys.argv[1])
import grpc, shardopt_pb2, shardopt_pb2_grpc
stub = shardopt_pb2_grpc.CoordinatorStub(grpc.insecure_channel(sys.argv[2]))
call = stub.KvGet.future(shardopt_pb2.KvGetRequest(key="nobody-sets-this", wait_ms=600000),
                         timeout=700, wait_for_ready=True)
time.sleep(1)  # a delay on purpose (no event says the call arrived): it waits in the coordinator now
open(sys.argv[3], "w").close()  # let the ranks train
try:
    call.result()
    print("OK")
except grpc.RpcError as e:
    print(e.code().name, e.details())
PY
# The ranks start training once the KvGet waits.
cat >"$tmp/gated.sh" <<SH
#!/usr/bin/env bash
source "$PWD/tests/testing/lib.sh" || exit 1
wait_until 60 "the KvGet to wait in the coordinator ($tmp/go)" test -e "$tmp/go"
exec $PWD/tools/shardopt_train --model=tiny --steps=5
SH
chmod +x "$tmp/gated.sh"
timeout 300 tools/shardrun --nproc 2 --port-file "$tmp/addr2" -- "$tmp/gated.sh" >"$tmp/short.log" 2>&1 &
run=$!
wait_file "$tmp/addr2" 10
/usr/bin/python3 "$tmp/kvget.py" "$tmp" "$(cat "$tmp/addr2")" "$tmp/go" >"$tmp/kvget.out" 2>&1 &
kv=$!
wait_until 30 "the KvGet client to start waiting (it creates $tmp/go)" test -e "$tmp/go"
start=$(date +%s)
wait $run
rc=$?
took=$(( $(date +%s) - start ))
check "short job succeeds (rc $rc)" test $rc -eq 0
check "shardrun exits despite a waiting KvGet ($took s after the ranks started)" test $took -le 20
exited() { ! kill -0 "$1" 2>/dev/null; }
wait_until 10 "the KvGet client to exit" exited $kv
check "the waiting KvGet ended: $(cat "$tmp/kvget.out")" grep -q '^UNAVAILABLE coordinator shutting down' "$tmp/kvget.out"

if [[ $fails -ne 0 ]]; then
  echo "---- logs"; tail -n 20 "$tmp"/*.log
  exit 1
fi
