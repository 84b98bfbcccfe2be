# shellcheck shell=bash
# Helpers shared by the shell tests (tests/e2e/*.sh). A test sources it after its
# `set` line:
#   source tests/testing/lib.sh || exit 1
# (lib.sh is a data dependency of every shell test; under `bazel test` the
# runfiles tree is the working directory.)
# Tests run from the workspace root (tools/shardctl is a relative path).
#
# Waits are on conditions, not time: poll what is about to be asserted with
# wait_until; a fixed sleep stays only where a test needs a delay on purpose,
# with a comment saying why.

fails=0

# check NAME COMMAND...: runs COMMAND; prints "PASS NAME" or "FAIL NAME" and
# counts the failures in $fails.
check() {
  local name=$1
  shift
  if "$@"; then echo "PASS $name"; else echo "FAIL $name"; fails=$((fails + 1)); fi
}

# Microseconds since the epoch; of a number of seconds (decimal: 0.5, 30).
_lib_now_us() { echo "${EPOCHREALTIME/[.,]/}"; }
_lib_us() {
  local s=$1 i f=""
  i=${s%%.*}
  [[ $s == *.* ]] && f=${s#*.}
  f="${f}000000"
  echo $((10#${i:-0} * 1000000 + 10#${f:0:6}))
}

# wait_until TIMEOUT_S DESCRIPTION COMMAND...: runs COMMAND every 0.1 s until
# it succeeds (status 0), for at most TIMEOUT_S seconds (a decimal number).
# COMMAND runs in this shell (a function may set variables for the caller),
# at once and once more at the deadline. On a timeout it says on stderr what
# it waited for and returns 1, so `check NAME wait_until ...` fails NAME.
wait_until() {
  if [[ $# -lt 3 || ! $1 =~ ^[0-9]+(\.[0-9]*)?$ ]]; then
    echo "wait_until: usage: wait_until TIMEOUT_S DESCRIPTION COMMAND... (got: $*)" >&2
    return 2
  fi
  local timeout=$1 what=$2
  shift 2
  local now end left
  now=$(_lib_now_us)
  end=$((now + $(_lib_us "$timeout")))
  while true; do
    "$@" && return 0
    now=$(_lib_now_us)
    left=$((end - now))
    if ((left <= 0)); then
      echo "wait_until: timed out after ${timeout} s waiting for: $what" >&2
      return 1
    fi
    if ((left < 100000)); then sleep "$(printf '0.%06d' "$left")"; else sleep 0.1; fi
  done
}

# wait_file FILE [TIMEOUT_S]: until FILE exists and is not empty (an address
# shardrun writes with --port-file, an exit status a pane script records);
# at most TIMEOUT_S seconds, 30 by default.
wait_file() {
  wait_until "${2:-30}" "$1 to be written" test -s "$1"
}

# rank_pid JOBTAG RANK [PATTERN]: the pid of rank RANK of the job started with
# --job-id=JOBTAG (any job when JOBTAG is empty), among the processes whose
# command line matches PATTERN (default shardopt_train). A rank's process
# carries RANK only once exec'd: a forked child still has shardrun's
# environment.
rank_pid() {
  local p
  for p in $(pgrep -f "${3:-shardopt_train}"); do
    if { [[ -z $1 ]] || tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -x "SHARDOPT_JOB_ID=$1" >/dev/null; } &&
       tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -x "RANK=$2" >/dev/null; then echo "$p"; fi
  done
}

# no_ranks JOBTAG RANK...: no process of those ranks of the job is left.
no_ranks() {
  local tag=$1 r
  shift
  for r in "$@"; do
    [[ -z "$(rank_pid "$tag" "$r")" ]] || return 1
  done
}

# job_step ADDR [SHARDCTL FLAG...]: the step `shardctl status` reports for
# the running job at ADDR (the lowest over its ranks, from their heartbeats);
# empty when it is not running or cannot be reached.
job_step() {
  local addr=$1
  shift
  timeout 30 tools/shardctl --coordinator="$addr" "$@" status 2>/dev/null |
    sed -n 's/^job .*: running, [0-9]* ranks, step \([0-9]*\),.*/\1/p'
}

# job_past_step ADDR N [SHARDCTL FLAG...]: every rank of the job at ADDR has
# reported a step after N (the job is training, not starting).
job_past_step() {
  local s
  s=$(job_step "$1" "${@:3}")
  [[ -n $s ]] && ((s > $2))
}

# two_hosts NS1 NS2 NET TAG: two "hosts", network namespaces NS1 (at NET.1)
# and NS2 (at NET.2, a /24) joined by a veth pair named after TAG, loopback
# up. Needs root (CAP_NET_ADMIN); when the first namespace cannot be made it
# returns 2 with the reason in $two_hosts_error (tests say SKIPPED), on any
# later failure 1. The caller deletes the namespaces (ip netns del).
two_hosts() {
  local ns1=$1 ns2=$2 net=$3 tag=$4
  if ! two_hosts_error=$(ip netns add "$ns1" 2>&1); then return 2; fi
  ip netns add "$ns2" &&
    ip link add "va$tag" type veth peer name "vb$tag" &&
    ip link set "va$tag" netns "$ns1" &&
    ip link set "vb$tag" netns "$ns2" &&
    ip -n "$ns1" addr add "$net.1/24" dev "va$tag" &&
    ip -n "$ns2" addr add "$net.2/24" dev "vb$tag" &&
    ip -n "$ns1" link set lo up && ip -n "$ns2" link set lo up &&
    ip -n "$ns1" link set "va$tag" up && ip -n "$ns2" link set "vb$tag" up
}

# two_hosts_or_skip NS1 NS2 NET TAG: two_hosts, or end the test: SKIPPED
# (exit 0) when namespaces cannot be made here, FAIL (exit 1) on a later error.
two_hosts_or_skip() {
  two_hosts "$@"
  case $? in
    0) ;;
    2) echo "SKIPPED: cannot create network namespaces here: $two_hosts_error"; exit 0 ;;
    *) echo "FAIL: setting up the two hosts"; exit 1 ;;
  esac
}
