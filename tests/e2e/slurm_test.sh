#!/usr/bin/env bash
# Slurm for real: munged, a slurmctld and two slurmd "nodes" (n1, n2) in two
# network namespaces with their own addresses (node n1 is also the login
# node: srun, sbatch, scancel and shardctl run there), with a slurm.conf
# written here (cons_tres, no accounting database). Then:
#  1. srun -N2 --ntasks-per-node=2 shardopt_train: 4 ranks over both nodes,
#     rank 0 serving the coordinator on n1; the checkpoint equals a
#     `shardrun --nproc 4` run's on the same data bit for bit; the same under
#     srun --ntasks-per-node=1 shardrun --nproc 2;
#  2. the same with a Python script calling shardopt.init() (parameters,
#     BatchNorm buffers and optimizer state bitwise equal to shardrun's);
#  3. shardctl from the login node with the job's token; kill -9 of one rank:
#     the others exit within the heartbeat timeout naming the rank and its
#     node, the last checkpoint verifies; kill -9 of rank 0 (the coordinator's
#     process): the others name it; scancel of a running job and of one step:
#     it ends at once and its last checkpoint verifies;
#  4. resume with srun -N1 --ntasks-per-node=3 (4 ranks' checkpoint at 3),
#     bitwise equal to shardrun --nproc 3 resuming the same checkpoint;
#  5. sbatch of examples/slurm/train_cpp.sbatch and train_python.sbatch,
#     waited for by polling `scontrol show job` (no accounting database),
#     output checked.
# Every daemon, process and namespace is removed at the end, also on failure.
# Needs root and Debian's slurm-wlm and munge (tools/setup.sh installs them);
# without them the test says SKIPPED and why.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
export PATH="$PATH:/usr/sbin:/sbin"
root=$PWD
B=$root/tools
started=$(date +%s)

if [[ $(id -u) -ne 0 ]]; then
  echo "SKIPPED: needs root (network namespaces, slurmd)"
  exit 0
fi
for c in munged slurmctld slurmd srun sbatch scancel scontrol sinfo nsenter unshare ip; do
  if ! command -v "$c" >/dev/null; then
    echo "SKIPPED: $c not found (tools/setup.sh installs slurm-wlm and munge)"
    exit 0
  fi
done

id=$$
h1=so-sl1-$id; h2=so-sl2-$id
net=10.$((100 + id % 100)).$((id / 100 % 250))
tmp=$(mktemp -d)
chmod 755 "$tmp"
daemons=()
cleanup() {
  [[ -f $tmp/slurm.conf ]] && timeout 10 nsenter --net="/run/netns/$h1" scancel --quiet \
    --user=root 2>/dev/null
  for ns in "$h1" "$h2"; do  # every process left in a node: tasks, slurmstepd, daemons
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
  done
  for p in "${daemons[@]}"; do kill -9 "$p" 2>/dev/null; done
  [[ -f $tmp/munge.pid ]] && kill -9 "$(cat "$tmp/munge.pid")" 2>/dev/null
  kill $(jobs -p) 2>/dev/null
  wait 2>/dev/null
  ip netns del "$h1" 2>/dev/null
  ip netns del "$h2" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
two_hosts_or_skip "$h1" "$h2" "$net" "sl$id"
set -e
printf '127.0.0.1 localhost\n%s n1\n%s n2\n' "$net.1" "$net.2" >"$tmp/hosts"

# in_node NS CMD...: CMD in node NS's network, where n1 and n2 resolve (a
# mount namespace of its own with $tmp/hosts as /etc/hosts; /sys stays the
# host's, so slurmd finds its cgroups, unlike under `ip netns exec`).
in_node() {
  local ns=$1
  shift
  nsenter --net="/run/netns/$ns" unshare -m --propagation private \
    sh -c 'mount --bind "$0" /etc/hosts && exec "$@"' "$tmp/hosts" "$@"
}

mkdir -p "$tmp/state" "$tmp/spool/n1" "$tmp/spool/n2" "$tmp/log" "$tmp/work"
dd if=/dev/urandom of="$tmp/munge.key" bs=1024 count=1 2>/dev/null
chmod 400 "$tmp/munge.key"
munged --key-file="$tmp/munge.key" --socket="$tmp/munge.sock" --pid-file="$tmp/munge.pid" \
  --log-file="$tmp/log/munge.log" --seed-file="$tmp/munge.seed" --force
cat >"$tmp/slurm.conf" <<EOF
ClusterName=shardopt
SlurmctldHost=$(hostname -s)($net.1)
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket=$tmp/munge.sock
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool/%n
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd-%n.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd-%n.log
ReturnToService=2
KillWait=5
NodeName=n1 NodeAddr=$net.1 CPUs=4 State=UNKNOWN
NodeName=n2 NodeAddr=$net.2 CPUs=4 State=UNKNOWN
PartitionName=main Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
export SLURM_CONF=$tmp/slurm.conf
in_node "$h1" slurmctld -D -c -f "$SLURM_CONF" >"$tmp/log/ctld.out" 2>&1 &
daemons+=($!)
in_node "$h1" slurmd -D -N n1 -f "$SLURM_CONF" >"$tmp/log/d1.out" 2>&1 &
daemons+=($!)
in_node "$h2" slurmd -D -N n2 -f "$SLURM_CONF" >"$tmp/log/d2.out" 2>&1 &
daemons+=($!)
set +e
login() { in_node "$h1" "$@"; }  # a command on the login node (n1)
nodes_idle() { [[ $(login sinfo -h -o '%D %T' 2>/dev/null) == "2 idle" ]]; }
if ! wait_until 60 "both slurmd nodes idle" nodes_idle; then
  echo "FAIL slurm cluster up"
  login sinfo
  tail -n 5 "$tmp"/log/*
  exit 1
fi
echo "slurm: controller and n1 at $net.1, n2 at $net.2 ($(($(date +%s) - started)) s)"
cd "$tmp/work"  # srun runs every task in the submitting directory

# consolidate CKPT OUT: one file of every parameter and optimizer state.
consolidate() { "$B/shardctl" consolidate "$1" "$2" >/dev/null 2>&1; }

# 1. The C++ trainer: srun's tasks are the ranks, bitwise equal to shardrun.
train=(--model=small --steps=6 --ckpt-every=3 --batch=6)
login timeout 120 srun -N2 --ntasks-per-node=2 "$B/shardopt_train" "${train[@]}" \
  --ckpt-dir="$tmp/ck_srun" >"$tmp/srun.log" 2>&1
check "1: srun -N2 --ntasks-per-node=2 shardopt_train" test $? -eq 0
check "1: rank 0 serves the coordinator on the first node" \
  grep -q "coordinator listening on n1:[0-9]* (slurm job [0-9]*, 4 ranks" "$tmp/srun.log"
check "1: gloo across the two nodes" grep -q "transport gloo (auto: ranks on several hosts)" \
  "$tmp/srun.log"
timeout 120 "$B/shardrun" --nproc 4 -- "$B/shardopt_train" "${train[@]}" \
  --ckpt-dir="$tmp/ck_shardrun" >"$tmp/shardrun.log" 2>&1
check "1: shardrun --nproc 4 on the same data" test $? -eq 0
consolidate "$tmp/ck_srun/step-6" "$tmp/srun.st"
consolidate "$tmp/ck_shardrun/step-6" "$tmp/shardrun.st"
check "1: parameters and optimizer state equal shardrun's bit for bit" \
  cmp "$tmp/srun.st" "$tmp/shardrun.st"
login timeout 120 srun -N2 --ntasks-per-node=1 "$B/shardrun" --nproc 2 -- \
  "$B/shardopt_train" "${train[@]}" --ckpt-dir="$tmp/ck_nested" >"$tmp/nested.log" 2>&1
check "1: srun --ntasks-per-node=1 shardrun --nproc 2 (2 nodes)" test $? -eq 0
check "1: node 0's shardrun serves the coordinator on n1" \
  grep -q "shardrun: coordinator listening on n1:[0-9]* (slurm job [0-9]*, 4 ranks)" \
  "$tmp/nested.log"
consolidate "$tmp/ck_nested/step-6" "$tmp/nested.st"
check "1: ... bit for bit the same as well" cmp "$tmp/nested.st" "$tmp/shardrun.st"
login timeout 60 srun -N1 --ntasks-per-node=2 "$B/shardrun" --nproc 2 -- "$B/shardopt_train" \
  >"$tmp/two_per_node.log" 2>&1
check "1: two shardruns on one node refused (exit $?)" \
  grep -q "run one per node (srun --ntasks-per-node=1 shardrun" "$tmp/two_per_node.log"
echo "1 done ($(($(date +%s) - started)) s)"

# 2. Python: shardopt.init() under srun.
export PYTHONPATH=$root/python
job=("$root/tests/python/launcher_job.py" --steps=5)
login timeout 120 srun -N2 --ntasks-per-node=2 /usr/bin/python3 "${job[@]}" \
  --out="$tmp/py_srun.pt" >"$tmp/py_srun.log" 2>&1
check "2: srun -N2 --ntasks-per-node=2 python3 (shardopt.init())" test $? -eq 0
check "2: init() says slurm, control plane on" \
  grep -q "rank 3 of 4, launcher slurm, control plane on" "$tmp/py_srun.log"
timeout 120 "$B/shardrun" --nproc 4 -- /usr/bin/python3 "${job[@]}" --out="$tmp/py_ref.pt" \
  >"$tmp/py_ref.log" 2>&1
check "2: the same script under shardrun --nproc 4" test $? -eq 0
check "2: parameters, buffers and optimizer state equal shardrun's bit for bit" \
  /usr/bin/python3 "$root/tests/python/compare_states.py" "$tmp/py_srun.pt" "$tmp/py_ref.pt"
echo "2 done ($(($(date +%s) - started)) s)"

# 3. Failures as Slurm delivers them. A long job with a token; shardctl on
# the login node reaches its coordinator.
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$tmp/token"
chmod 600 "$tmp/token"
long=(--model=small --steps=100000 --batch=64 --ckpt-every=20 --log-every=100)
SHARDOPT_TOKEN_FILE=$tmp/token login timeout 120 srun -N2 --ntasks-per-node=2 \
  "$B/shardopt_train" "${long[@]}" --ckpt-dir="$tmp/ck_kill" >"$tmp/kill.log" 2>&1 &
srun_pid=$!
coordinator=""
find_coordinator() {
  coordinator=$(sed -n 's/.*coordinator listening on \(n1:[0-9]*\) .*/\1/p' "$tmp/kill.log")
  [[ -n $coordinator ]]
}
past_step() {  # the job reports every rank past step 40 to shardctl
  local s
  s=$(login timeout 20 "$B/shardctl" --coordinator="$coordinator" --token-file="$tmp/token" \
    status 2>/dev/null | sed -n 's/^job .*: running, 4 ranks, step \([0-9]*\),.*/\1/p')
  [[ -n $s ]] && ((s > 40))
}
check "3: coordinator address printed" wait_until 60 "the coordinator's address" find_coordinator
check "3: shardctl status from the login node (with the token)" \
  wait_until 60 "the job past step 40" past_step
refused_without_token() {
  ! login timeout 20 "$B/shardctl" --coordinator="$coordinator" status >/dev/null 2>&1
}
check "3: shardctl without the token is refused" refused_without_token
# task_pid R: the process of srun task R into $victim (grep without -q: an
# early exit would fail tr with SIGPIPE under pipefail).
victim=""
task_pid() {
  local p
  victim=""
  for p in $(pgrep -x shardopt_train); do
    if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -x "SLURM_PROCID=$1" >/dev/null; then
      victim=$p
    fi
  done
  [[ -n $victim ]]
}
check "3: rank 2's process found on n2" wait_until 10 "task 2's process" task_pid 2
killed_at=$(_lib_now_us)
kill -9 "$victim"
wait "$srun_pid"
rc=$?
took_ms=$((($(_lib_now_us) - killed_at) / 1000))
echo "3: srun ended $took_ms ms after kill -9 of rank 2 (exit $rc)"
check "3: the job ends within the heartbeat timeout (10 s) of kill -9" test "$took_ms" -lt 10000
check "3: the others name rank 2 and its node" \
  grep -q "rank 2 lost its connection to the coordinator .* (on host n2)" "$tmp/kill.log"
check "3: srun reports the failure" test "$rc" -ne 0
check "3: the last checkpoint verifies" \
  bash -c "'$B/shardctl' inspect '$tmp/ck_kill' | grep -q 'verify: every CRC matches'"

# kill -9 of rank 0, whose process serves the coordinator.
login timeout 120 srun -N2 --ntasks-per-node=2 "$B/shardopt_train" "${long[@]}" \
  --ckpt-dir="$tmp/ck_kill0" >"$tmp/kill0.log" 2>&1 &
srun_pid=$!
past_step_file() { grep -q 'step [0-9]*/100000' "$tmp/kill0.log"; }
check "3: a job trains" wait_until 60 "the job's first progress line" past_step_file
check "3: rank 0's process found on n1" wait_until 10 "task 0's process" task_pid 0
killed_at=$(_lib_now_us)
kill -9 "$victim"
wait "$srun_pid"
took_ms=$((($(_lib_now_us) - killed_at) / 1000))
echo "3: srun ended $took_ms ms after kill -9 of rank 0"
check "3: within the heartbeat timeout" test "$took_ms" -lt 10000
check "3: the others name rank 0 on n1, which served the coordinator" \
  grep -q "rank 0 (on host n1), whose process served the job's coordinator, is gone" \
  "$tmp/kill0.log"

# cancel_case WHAT CKPT: scancel the job (WHAT "") or its step (".0") once it
# has checkpointed; it must end at once and leave a checkpoint that verifies.
cancel_case() {
  local what=$1 ck=$2 pid jobid start ms
  rm -rf "$ck"
  login timeout 120 srun -N2 --ntasks-per-node=2 "$B/shardopt_train" "${long[@]}" \
    --ckpt-dir="$ck" >"$tmp/cancel$what.log" 2>&1 &
  pid=$!
  check "3: job for scancel$what checkpoints" wait_until 60 "a checkpoint in $ck" test -e "$ck/LATEST"
  jobid=$(login squeue -h -o %i | head -n 1)
  start=$(_lib_now_us)
  login scancel "$jobid$what"
  wait "$pid"
  ms=$((($(_lib_now_us) - start) / 1000))
  echo "3: srun ended $ms ms after scancel $jobid$what"
  check "3: scancel $jobid$what ends it within the heartbeat timeout" test "$ms" -lt 10000
  check "3: its last checkpoint verifies" \
    bash -c "'$B/shardctl' inspect '$ck' | grep -q 'verify: every CRC matches'"
}
cancel_case "" "$tmp/ck_cancel_job"   # the job
cancel_case ".0" "$tmp/ck_cancel"     # one step
echo "3 done ($(($(date +%s) - started)) s)"

# 4. Resume on one node with 3 tasks: the checkpoint of 4 ranks, taken at
# step S; equal to shardrun --nproc 3 resuming the same checkpoint.
step=$(cat "$tmp/ck_cancel/LATEST")
step=${step#step-}
resume=(--model=small --batch=64 --steps=$((step + 4)))
login timeout 120 srun -N1 --ntasks-per-node=3 "$B/shardopt_train" "${resume[@]}" \
  --resume="$tmp/ck_cancel" --ckpt-dir="$tmp/ck_resumed" >"$tmp/resume.log" 2>&1
check "4: srun -N1 --ntasks-per-node=3 --resume" test $? -eq 0
check "4: resumed the 4 ranks' checkpoint at 3" \
  grep -q "resumed from .*(sharded, saved by 4 ranks) at step $step" "$tmp/resume.log"
timeout 120 "$B/shardrun" --nproc 3 -- "$B/shardopt_train" "${resume[@]}" \
  --resume="$tmp/ck_cancel" --ckpt-dir="$tmp/ck_resumed_ref" >"$tmp/resume_ref.log" 2>&1
check "4: shardrun --nproc 3 resuming the same checkpoint" test $? -eq 0
consolidate "$tmp/ck_resumed/step-$((step + 4))" "$tmp/resumed.st"
consolidate "$tmp/ck_resumed_ref/step-$((step + 4))" "$tmp/resumed_ref.st"
check "4: ... bit for bit the same" cmp "$tmp/resumed.st" "$tmp/resumed_ref.st"
echo "4 done ($(($(date +%s) - started)) s)"

# 5. The documented sbatch script, as written (its variables point it at
# this build and a small model), waited for without an accounting database.
jobid=$(SHARDOPT_BIN=$B CKPT_DIR=$tmp/ck_sbatch MODEL=small STEPS=12 \
  login sbatch --parsable "$root/examples/slurm/train_cpp.sbatch")
jobid=${jobid%%;*}
check "5: sbatch examples/slurm/train_cpp.sbatch" test -n "$jobid"
state=""
job_ended() {
  state=$(login scontrol show job "$jobid" 2>/dev/null | grep -o 'JobState=[A-Z_]*')
  [[ -n $state && $state != *PENDING* && $state != *RUNNING* && $state != *COMPLETING* ]]
}
check "5: the batch job ends" wait_until 90 "job $jobid to end" job_ended
check "5: it completed ($state)" test "$state" = JobState=COMPLETED
out="$tmp/work/shardopt-cpp-$jobid.out"
check "5: 4 ranks on n[1-2]" grep -q "^job $jobid on n\[1-2\]: 4 ranks, model small" "$out"
check "5: trained 12 steps" grep -q "done: 12 steps" "$out"
check "5: its checkpoint verifies" grep -q "verify: every CRC matches" "$out"
check "5: the token file is gone" test ! -e "$tmp/work/.shardopt-$jobid.token"
pyjob=$(SHARDOPT_PYTHONPATH=$root/python TRAIN_SCRIPT=$root/examples/train.py \
  CKPT_DIR=$tmp/ck_sbatch_py STEPS=2 BATCH=2 login sbatch --parsable \
  "$root/examples/slurm/train_python.sbatch")
jobid=${pyjob%%;*}
check "5: sbatch examples/slurm/train_python.sbatch" test -n "$jobid"
check "5: the Python batch job ends" wait_until 120 "job $jobid to end" job_ended
check "5: it completed ($state)" test "$state" = JobState=COMPLETED
pyout="$tmp/work/shardopt-py-$jobid.out"
check "5: train.py ran 4 ranks under slurm" \
  grep -q "train.py: resnet18, 4 ranks (slurm)" "$pyout"
check "5: and checkpointed" grep -q "checkpoint $tmp/ck_sbatch_py/step-2" "$pyout"
echo "5 done ($(($(date +%s) - started)) s)"

if [[ $fails -ne 0 ]]; then
  for f in "$tmp"/*.log "$out" "${pyout:-}"; do
    [[ -f $f ]] && { echo "--- $f"; grep -v '^\[#\|^\[rank [0-9]*\] \[#' "$f" | tail -n 15; }
  done
  tail -n 5 "$tmp"/log/slurm*.log
  exit 1
fi
echo "slurm_test: all passed in $(($(date +%s) - started)) s"
