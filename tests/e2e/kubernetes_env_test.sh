#!/usr/bin/env bash
# Kubernetes on paper: no cluster here, so the pods of an Indexed Job are
# processes given the variables Kubernetes and examples/kubernetes/train-job.yaml
# set (JOB_COMPLETION_INDEX, WORLD_SIZE, MASTER_ADDR, SHARDOPT_PORT,
# SHARDOPT_BIND), on 127.0.0.1 and an OS-chosen port:
#  1. the manifest is consistent (Indexed, completions = WORLD_SIZE, the pods'
#     subdomain is the headless Service, MASTER_ADDR names pod 0 through it,
#     SHARDOPT_PORT is the Service's port);
#  2. 3 "pods" of shardopt_train, pod 0 started last (the others wait for its
#     coordinator): bitwise equal to shardrun --nproc 3;
#  3. the same with a Python script calling shardopt.init();
#  4. 2 "pods" each running shardrun --nproc 2 (4 ranks);
#  5. a pod's process killed: the others exit naming its rank and host;
#  6. bad variables refused by name.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
root=$PWD
B=$root/tools
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; rm -rf "$tmp"' EXIT
export PYTHONPATH=$root/python

# 1. The manifest.
check "1: the manifest maps the pod index to the rank" /usr/bin/python3 - \
  "$root/examples/kubernetes/train-job.yaml" <<'EOF'
import sys
import yaml
docs = {d["kind"]: d for d in yaml.safe_load_all(open(sys.argv[1]))}
svc, job = docs["Service"], docs["Job"]
spec = job["spec"]
pod = spec["template"]["spec"]
env = {e["name"]: e for e in pod["containers"][0]["env"]}
name, svc_name = job["metadata"]["name"], svc["metadata"]["name"]
checks = {
    "Indexed": spec["completionMode"] == "Indexed",
    "all pods at once": spec["parallelism"] == spec["completions"],
    "WORLD_SIZE = completions": int(env["WORLD_SIZE"]["value"]) == spec["completions"],
    "headless Service": svc["spec"]["clusterIP"] == "None",
    "Service selects the Job's pods": svc["spec"]["selector"] == {"job-name": name},
    "subdomain = Service": pod["subdomain"] == svc_name,
    "MASTER_ADDR = pod 0": env["MASTER_ADDR"]["value"] == f"{name}-0.{svc_name}",
    "SHARDOPT_PORT = Service port":
        int(env["SHARDOPT_PORT"]["value"]) == svc["spec"]["ports"][0]["port"],
    "SHARDOPT_BIND = pod IP":
        env["SHARDOPT_BIND"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP",
    "no RANK (the index is the rank)": "RANK" not in env,
}
bad = [k for k, ok in checks.items() if not ok]
print("manifest: " + ("; ".join(bad) + " WRONG" if bad else f"{len(checks)} checks hold"))
sys.exit(1 if bad else 0)
EOF

free_port() {
  /usr/bin/python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# pods N LOG CMD...: N "pods" of CMD with an Indexed Job's variables, pod 0
# last; each pod's output in LOG.I. Returns non-zero if any pod failed.
pods() {
  local n=$1 log=$2
  shift 2
  local port i pids=() rc=0
  port=$(free_port)
  for ((i = n - 1; i >= 0; i--)); do
    env -u RANK -u SHARDOPT_COORDINATOR JOB_COMPLETION_INDEX=$i WORLD_SIZE=$n \
      MASTER_ADDR=127.0.0.1 SHARDOPT_PORT="$port" SHARDOPT_LISTEN=127.0.0.1 \
      SHARDOPT_BIND=127.0.0.1 HOSTNAME="train-$i" SHARDOPT_JOB_ID=k8s-test \
      timeout 120 "$@" >"$log.$i" 2>&1 &
    pids+=($!)
    # On purpose: the other pods start well before pod 0 serves the
    # coordinator, as when its node pulls the image last.
    if ((i == 1)); then sleep 2; fi
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}

consolidate() { "$B/shardctl" consolidate "$1" "$2" >/dev/null 2>&1; }
train=(--model=small --steps=6 --batch=6)

# 2. One rank per pod, C++.
pods 3 "$tmp/cpp" "$B/shardopt_train" "${train[@]}" --ckpt-dir="$tmp/ck_pods"
check "2: 3 pods of shardopt_train" test $? -eq 0
check "2: pod 0 serves the coordinator" \
  grep -q "coordinator listening on 127.0.0.1:[0-9]* (kubernetes job k8s-test, 3 ranks" "$tmp/cpp.0"
timeout 120 "$B/shardrun" --nproc 3 -- "$B/shardopt_train" "${train[@]}" \
  --ckpt-dir="$tmp/ck_ref3" >"$tmp/ref3.log" 2>&1
check "2: shardrun --nproc 3" test $? -eq 0
consolidate "$tmp/ck_pods/step-6" "$tmp/pods.st"
consolidate "$tmp/ck_ref3/step-6" "$tmp/ref3.st"
check "2: bit for bit shardrun's" cmp "$tmp/pods.st" "$tmp/ref3.st"

# 3. One rank per pod, Python.
job=("$root/tests/python/launcher_job.py" --steps=4)
pods 3 "$tmp/py" /usr/bin/python3 "${job[@]}" --out="$tmp/py_pods.pt"
check "3: 3 pods of a Python script (shardopt.init())" test $? -eq 0
check "3: init() says kubernetes, control plane on" \
  grep -q "rank 2 of 3, launcher kubernetes, control plane on, job k8s-test" "$tmp/py.2"
timeout 120 "$B/shardrun" --nproc 3 -- /usr/bin/python3 "${job[@]}" --out="$tmp/py_ref.pt" \
  >"$tmp/py_ref.log" 2>&1
check "3: the same script under shardrun --nproc 3" test $? -eq 0
check "3: parameters, buffers and optimizer state bitwise shardrun's" \
  /usr/bin/python3 "$root/tests/python/compare_states.py" "$tmp/py_pods.pt" "$tmp/py_ref.pt"

# 4. shardrun in each pod: the pods are its nodes.
pods 2 "$tmp/nested" "$B/shardrun" --nproc 2 -- "$B/shardopt_train" "${train[@]}" \
  --ckpt-dir="$tmp/ck_nested"
check "4: 2 pods of shardrun --nproc 2" test $? -eq 0
check "4: pod 0's shardrun serves 4 ranks" \
  grep -q "coordinator listening on 127.0.0.1:[0-9]* (kubernetes job k8s-test, 4 ranks)" \
  "$tmp/nested.0"
timeout 120 "$B/shardrun" --nproc 4 -- "$B/shardopt_train" "${train[@]}" \
  --ckpt-dir="$tmp/ck_ref4" >"$tmp/ref4.log" 2>&1
consolidate "$tmp/ck_nested/step-6" "$tmp/nested.st"
consolidate "$tmp/ck_ref4/step-6" "$tmp/ref4.st"
check "4: bit for bit shardrun --nproc 4's" cmp "$tmp/nested.st" "$tmp/ref4.st"

# 5. A pod's process killed mid-training.
pods 3 "$tmp/kill" "$B/shardopt_train" --model=small --steps=100000 --batch=64 --log-every=100 &
group=$!
victim=""
find_victim() {
  victim=""
  local p
  for p in $(pgrep -x shardopt_train); do  # the process itself, not its `timeout`
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -x JOB_COMPLETION_INDEX=1 >/dev/null; then
      victim=$p
    fi
  done
  [[ -n $victim ]] && grep -q 'step [0-9]*/100000' "$tmp/kill.0" 2>/dev/null
}
check "5: the job trains" wait_until 60 "pod 1's process, training" find_victim
killed_at=$(_lib_now_us)
kill -9 "$victim"
wait "$group"
took_ms=$((($(_lib_now_us) - killed_at) / 1000))
echo "5: the other pods ended $took_ms ms after kill -9 of pod 1"
check "5: within the heartbeat timeout" test "$took_ms" -lt 10000
check "5: pods 0 and 2 name rank 1 and its host" \
  grep -q "rank 1 lost its connection to the coordinator .* (on host 127.0.0.1)" \
  "$tmp/kill.0" "$tmp/kill.2"

# 6. Variables a manifest can get wrong.
refused() {  # refused NAME TEXT VAR=VALUE...: exit 2 and TEXT in the message
  local name=$1 text=$2
  shift 2
  env -u RANK -u WORLD_SIZE -u SHARDOPT_COORDINATOR "$@" timeout 30 "$B/shardopt_train" \
    --model=tiny --steps=1 >"$tmp/refused.log" 2>&1
  local rc=$?
  check "6: $name refused (exit $rc)" test $rc -eq 2
  check "6: $name: message names $text" grep -q -- "$text" "$tmp/refused.log"
}
refused "index outside the Job" JOB_COMPLETION_INDEX JOB_COMPLETION_INDEX=3 WORLD_SIZE=3 \
  MASTER_ADDR=127.0.0.1
refused "no MASTER_ADDR" MASTER_ADDR JOB_COMPLETION_INDEX=0 WORLD_SIZE=3
refused "no world size" SHARDOPT_WORLD_SIZE JOB_COMPLETION_INDEX=0 MASTER_ADDR=127.0.0.1
refused "bad SHARDOPT_PORT" SHARDOPT_PORT JOB_COMPLETION_INDEX=0 WORLD_SIZE=2 \
  MASTER_ADDR=127.0.0.1 SHARDOPT_PORT=70000

if [[ $fails -ne 0 ]]; then
  for f in "$tmp"/*.[0-9] "$tmp"/*.log; do
    [[ -f $f ]] && { echo "--- $f"; grep -v "^\[#" "$f" | tail -n 8; }
  done
  exit 1
fi
