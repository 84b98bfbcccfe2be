#!/usr/bin/env bash
# A second, independent gRPC client (Debian's python3-grpcio, stubs generated
# from the same .proto) reads the layout of a running job.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT
if ! /usr/bin/python3 -c "import grpc, google.protobuf" 2>/dev/null; then
  echo "FAIL: python3-grpcio / python3-protobuf missing (tools/setup.sh installs them)"
  exit 1
fi
protoc -Iproto --python_out="$tmp" --grpc_out="$tmp" \
  --plugin=protoc-gen-grpc=/usr/bin/grpc_python_plugin proto/shardopt.proto || exit 1
tools/shardrun --nproc 2 --port-file "$tmp/addr" -- \
  tools/shardopt_train --model=small --steps=1000000 --log-every=100000 >"$tmp/run.log" 2>&1 &
wait_file "$tmp/addr" 20
addr=$(cat "$tmp/addr")
tools/shardctl --coordinator="$addr" status --wait=60 >/dev/null
/usr/bin/python3 tests/testing/layout_client.py "$tmp" "$addr"
rc=$?
tools/shardctl --coordinator="$addr" abort "test over" >/dev/null
wait
exit $rc
