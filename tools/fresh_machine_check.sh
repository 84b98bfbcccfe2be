#!/usr/bin/env bash
# Fresh-machine check (issue 29): does a clean Debian bookworm machine get from
# nothing to a working shardopt with only tools/setup.sh? Builds a minimal
# bookworm root with debootstrap, copies the checkout in, and inside it (chroot)
# runs tools/setup.sh, tools/demo.sh and a quick subset of the tests, timing
# each phase. Needs root. Run with --help for the options.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: sudo tools/fresh_machine_check.sh [options]

Checks that a fresh Debian bookworm machine can build and run shardopt with
nothing but tools/setup.sh. It
  1. debootstraps a minimal bookworm root (variant minbase) from this machine's
     Debian mirror (read from /etc/apt/sources.list*; installs the debootstrap
     package with apt-get if it is missing),
  2. copies the checkout in: the files `git ls-files` lists (tracked plus
     untracked-but-not-ignored, as in the working tree; no bazel-* symlinks,
     no build outputs) to /root/shardopt in the root,
  3. chroots in (/proc, /sys, /dev, /dev/pts, /dev/shm mounted, resolv.conf
     copied; everything is unmounted on exit, also on failure or Ctrl-C) and runs
       setup  tools/setup.sh
       demo   tools/demo.sh
       build  bazel build //...   (no CUDA toolkit there: GPU targets skipped)
       tests  bazel test --nocache_test_results TARGETS
  4. prints the wall time of each phase (debootstrap, setup, demo, build, tests) and
     a one-line verdict. Exit status 0 only if every phase passed; otherwise
     the failing phase is named, its last lines shown, and the status is 1.

The root has no /usr/local/cuda, so the build takes shardopt's CUDA-less path.
No daemon is started in the root (a policy-rc.d refuses it), and processes
left in the root at the end (the Bazel server) are stopped.

options:
  --root DIR          build the root in DIR (default: a new directory under
                      /var/tmp). A DIR this script created is removed at the
                      end unless --keep; a DIR that already held a debootstrapped
                      root is reused (debootstrap skipped: then it is no longer
                      a fresh machine) and never removed.
  --keep              keep the root at the end (it is still unmounted).
  --share-disk-cache  bind-mount this machine's Bazel disk cache
                      (~/.cache/shardopt-bazel-disk, see .bazelrc) at
                      /root/.cache/shardopt-bazel-disk in the root, so compiled
                      actions are reused: builds get faster, but what setup
                      installs does not change (the check of setup.sh is the
                      same). Test results are never taken from the cache.
  --tests "TARGETS"   the tests to run (default:
                      "//tests:planner_test //tests:cpu_kernels_test //tests:flags_test").
  --mirror URL        the Debian mirror (default: the one this machine uses).
  --phase-timeout S   the limit of every phase in seconds (default: debootstrap
                      1200, setup 2400, demo 2400, build 2400, tests 1800).
  -h, --help          this text.
EOF
}

ROOT=""
KEEP=0
SHARE_CACHE=0
TESTS="//tests:planner_test //tests:cpu_kernels_test //tests:flags_test"
MIRROR=""
PHASE_TIMEOUT=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --root) [[ $# -ge 2 && -n $2 ]] || { echo "fresh-machine: --root needs a directory" >&2; exit 2; }
            ROOT=$2; shift ;;
    --root=*) ROOT=${1#--root=} ;;
    --keep) KEEP=1 ;;
    --share-disk-cache) SHARE_CACHE=1 ;;
    --tests) [[ $# -ge 2 && -n $2 ]] || { echo "fresh-machine: --tests needs targets" >&2; exit 2; }
             TESTS=$2; shift ;;
    --tests=*) TESTS=${1#--tests=} ;;
    --mirror) [[ $# -ge 2 && -n $2 ]] || { echo "fresh-machine: --mirror needs a URL" >&2; exit 2; }
              MIRROR=$2; shift ;;
    --mirror=*) MIRROR=${1#--mirror=} ;;
    --phase-timeout) [[ $# -ge 2 ]] || { echo "fresh-machine: --phase-timeout needs seconds" >&2; exit 2; }
                     PHASE_TIMEOUT=$2; shift ;;
    --phase-timeout=*) PHASE_TIMEOUT=${1#--phase-timeout=} ;;
    *) echo "fresh-machine: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
if [[ -n $PHASE_TIMEOUT && ! $PHASE_TIMEOUT =~ ^[1-9][0-9]*$ ]]; then
  echo "fresh-machine: --phase-timeout must be a positive number of seconds, got '$PHASE_TIMEOUT'" >&2
  exit 2
fi
[[ -n ${TESTS// /} ]] || { echo "fresh-machine: --tests is empty" >&2; exit 2; }

if [[ $(id -u) -ne 0 ]]; then
  echo "fresh-machine: must run as root (debootstrap, mount and chroot need it):" >&2
  echo "  sudo $0 $*" >&2
  exit 1
fi

REPO=$(cd "$(dirname "$0")/.." && pwd)
REPO_IN_ROOT=/root/shardopt
CHROOT_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# ---------------------------------------------------------------- state
CREATED_ROOT=0      # 1: this script made ROOT (so it may remove it)
LOGDIR=""
PHASE_PID=""        # the running phase's `timeout` process
TAIL_PID=""
CLEANED=0
CURRENT=""          # the phase now running
declare -A TIME=() RESULT=()
PHASES=(debootstrap copy setup demo build tests)

say() { echo "fresh-machine: $*"; }

fmt_time() {  # SECONDS -> "151 s (2m31s)"
  local s=$1
  printf '%d s (%dm%02ds)' "$s" $((s / 60)) $((s % 60))
}

# Mount points at or under ROOT, deepest first (from /proc/self/mountinfo;
# ROOT is checked to hold no characters that mountinfo would escape).
mounts_under_root() {
  local -a found=()
  local _id _parent _dev _rel mp _rest
  while read -r _id _parent _dev _rel mp _rest; do
    if [[ $mp == "$ROOT" || $mp == "$ROOT"/* ]]; then found+=("$mp"); fi
  done </proc/self/mountinfo
  if [[ ${#found[@]} -gt 0 ]]; then
    printf '%s\n' "${found[@]}" | sort -r
  fi
}

# Processes whose root directory is ROOT (started in the chroot: the Bazel
# server, anything a phase left behind), each by its id.
kill_root_processes() {
  local pass pid r any
  for pass in TERM TERM KILL; do
    any=0
    for pid in /proc/[0-9]*; do
      pid=${pid#/proc/}
      r=$(readlink "/proc/$pid/root" 2>/dev/null) || continue
      if [[ $r == "$ROOT" ]]; then
        kill -s "$pass" "$pid" 2>/dev/null || true
        any=1
      fi
    done
    [[ $any -eq 1 ]] || return 0
    sleep 2
  done
}

cleanup() {  # [EXIT_STATUS]: logs are kept unless it is 0
  local rc=${1:-$?}
  [[ $CLEANED -eq 0 ]] || return 0
  CLEANED=1
  set +e
  if [[ -n $PHASE_PID ]]; then
    # `timeout` passes the signal to the phase's process group and kills it
    # 30 s later if it is still there, so this wait is bounded.
    kill -TERM "$PHASE_PID" 2>/dev/null
    wait "$PHASE_PID" 2>/dev/null
  fi
  if [[ -n $TAIL_PID ]]; then kill -TERM "$TAIL_PID" 2>/dev/null; fi
  if [[ -n $ROOT && -d $ROOT ]]; then
    if [[ -x $ROOT/usr/bin/bazel && -d $ROOT/proc/self ]]; then
      # Stop the root's Bazel server cleanly while /proc is still there.
      timeout -k 5 60 chroot "$ROOT" /usr/bin/env -i HOME=/root USER=root PATH="$CHROOT_PATH" \
        /bin/bash -c "cd $REPO_IN_ROOT 2>/dev/null && bazel shutdown" >/dev/null 2>&1 </dev/null
    fi
    kill_root_processes
    local mp left=()
    local -a mps=()
    mapfile -t mps < <(mounts_under_root)
    for mp in "${mps[@]}"; do
      umount "$mp" 2>/dev/null || umount -l "$mp" 2>/dev/null \
        || echo "fresh-machine: could not unmount $mp" >&2
    done
    mapfile -t left < <(mounts_under_root)
    if [[ ${#left[@]} -gt 0 ]]; then
      echo "fresh-machine: still mounted, root NOT removed (unmount by hand): ${left[*]}" >&2
    elif [[ $KEEP -eq 0 && $CREATED_ROOT -eq 1 ]]; then
      rm -rf --one-file-system "$ROOT"
    elif [[ $KEEP -eq 1 ]]; then
      say "root kept (unmounted) at $ROOT"
    fi
  fi
  if [[ -n $LOGDIR && -d $LOGDIR ]]; then
    if [[ $rc -eq 0 ]]; then rm -rf "$LOGDIR"; else echo "fresh-machine: phase logs kept in $LOGDIR" >&2; fi
  fi
  return 0
}

on_signal() {
  echo >&2
  # shellcheck disable=SC2016  # (a false positive: it is in double quotes)
  echo "fresh-machine: interrupted by SIG$1${CURRENT:+ during phase '$CURRENT'}; cleaning up" >&2
  CURRENT=""
  trap - EXIT
  cleanup 1
  [[ $1 == INT ]] && exit 130
  exit 143
}
trap cleanup EXIT
trap 'on_signal INT' INT
trap 'on_signal TERM' TERM
trap 'on_signal HUP' HUP

summary() {
  local p
  echo
  echo "== fresh-machine check: wall time per phase"
  for p in "${PHASES[@]}"; do
    if [[ -n ${RESULT[$p]:-} ]]; then
      printf '  %-12s %-24s %s\n' "$p" "$(fmt_time "${TIME[$p]}")" "${RESULT[$p]}"
    else
      printf '  %-12s %-24s %s\n' "$p" "-" "not run"
    fi
  done
}

fail() {  # PHASE MESSAGE
  local phase=$1 msg=$2
  RESULT[$phase]=${RESULT[$phase]:-FAILED}
  summary
  trap - EXIT
  cleanup 1    # its messages come before the verdict, the last line
  echo "FRESH-MACHINE CHECK FAILED in phase '$phase': $msg"
  exit 1
}

# run_phase NAME LIMIT_S COMMAND...: runs COMMAND bounded by LIMIT_S, its output
# shown as it comes and kept in LOGDIR/NAME.log; records time and result; on
# failure prints the last lines and exits 1 naming the phase. COMMAND runs in
# the background so that a signal reaches this script's trap at once.
run_phase() {
  local name=$1 limit=$2
  shift 2
  [[ -z $PHASE_TIMEOUT ]] || limit=$PHASE_TIMEOUT
  local log="$LOGDIR/$name.log" start rc=0
  echo
  echo "== phase $name (limit $(fmt_time "$limit"))"
  CURRENT=$name
  : >"$log"
  start=$(date +%s)
  timeout -k 30 "$limit" "$@" >>"$log" 2>&1 </dev/null &
  PHASE_PID=$!
  tail -n +1 -f --pid="$PHASE_PID" "$log" &
  TAIL_PID=$!
  wait "$PHASE_PID" || rc=$?
  PHASE_PID=""
  wait "$TAIL_PID" 2>/dev/null || true
  TAIL_PID=""
  TIME[$name]=$(( $(date +%s) - start ))
  CURRENT=""
  if [[ $rc -eq 0 ]]; then
    RESULT[$name]=PASSED
    echo "== phase $name PASSED in $(fmt_time "${TIME[$name]}")"
    return 0
  fi
  local why="exit status $rc"
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    why="timed out after $(fmt_time "$limit")"
    RESULT[$name]="FAILED (timeout)"
  else
    RESULT[$name]="FAILED (exit $rc)"
  fi
  echo
  echo "---- phase $name FAILED ($why); last 40 lines of its output:"
  tail -n 40 "$log"
  echo "----"
  if grep -q -e '/usr/local/cuda' -e 'nvcc' -e '@cuda' "$log"; then
    echo "fresh-machine: note: the failing output mentions CUDA (/usr/local/cuda, nvcc or @cuda);"
    echo "  the root has no /usr/local/cuda, so this is the CUDA-less build path failing."
  fi
  fail "$name" "$why (full output: $log)"
}

# IN_ROOT + "COMMAND": runs a bash command line in the root, in the checkout,
# with a clean environment like a fresh login's (set once ROOT is known).
IN_ROOT=()

# ---------------------------------------------------------------- prepare
LOGDIR=$(mktemp -d /var/tmp/shardopt-fresh-logs.XXXXXX)

if [[ -z $ROOT ]]; then
  ROOT=$(mktemp -d /var/tmp/shardopt-fresh-root.XXXXXX)
  CREATED_ROOT=1
else
  if [[ ! -e $ROOT ]]; then
    mkdir -p "$ROOT"
    CREATED_ROOT=1
  fi
  ROOT=$(cd "$ROOT" && pwd -P)
fi
if [[ ! $ROOT =~ ^/[A-Za-z0-9._/+-]+$ || $ROOT == / ]]; then
  echo "fresh-machine: --root must be a plain absolute path (letters, digits, . _ - + /), not '$ROOT'" >&2
  exit 2
fi
chmod 755 "$ROOT"
say "root: $ROOT"
IN_ROOT=(chroot "$ROOT" /usr/bin/env -i HOME=/root USER=root LOGNAME=root
  PATH="$CHROOT_PATH" LANG=C.UTF-8 TERM=dumb DEBIAN_FRONTEND=noninteractive /bin/bash -c)

# The mirror this machine uses: the first .../debian (and .../debian-security)
# URI in its apt sources (deb822 "URIs:" lines and one-line "deb" lines).
SECURITY=""
if [[ -z $MIRROR ]]; then
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    while read -r first rest; do
      case "$first" in
        URIs:) uris=$rest ;;
        deb) uris=$rest; [[ $uris == \[* ]] && uris=${uris#*] } ; uris=${uris%% *} ;;
        *) continue ;;
      esac
      for u in $uris; do
        u=${u%/}
        if [[ -z $MIRROR && $u == *://*/debian ]]; then MIRROR=$u; fi
        if [[ -z $SECURITY && $u == *://*/debian-security ]]; then SECURITY=$u; fi
      done
    done <"$f"
  done
  [[ -n $MIRROR ]] || MIRROR=http://deb.debian.org/debian
fi
MIRROR=${MIRROR%/}
[[ -n $SECURITY ]] || SECURITY="${MIRROR}-security"
say "mirror: $MIRROR (security: $SECURITY)"

if ! command -v debootstrap >/dev/null 2>&1; then
  say "installing the Debian package debootstrap"
  export DEBIAN_FRONTEND=noninteractive
  if ! timeout -k 30 900 apt-get install -y -q --no-install-recommends debootstrap; then
    timeout -k 30 600 apt-get update -q || true
    timeout -k 30 900 apt-get install -y -q --no-install-recommends debootstrap \
      || fail debootstrap "could not install the Debian package debootstrap (apt-get install debootstrap)"
  fi
fi

# ---------------------------------------------------------------- debootstrap
if [[ -x $ROOT/bin/bash && -f $ROOT/etc/debian_version && -x $ROOT/usr/bin/apt-get ]]; then
  say "$ROOT already holds a Debian root: debootstrap skipped (NOT a fresh machine)"
  TIME[debootstrap]=0
  RESULT[debootstrap]="SKIPPED (reused root)"
else
  if [[ -n $(ls -A "$ROOT") ]]; then
    echo "fresh-machine: $ROOT is not empty and holds no Debian root; give an empty or new --root" >&2
    CREATED_ROOT=0
    exit 2
  fi
  run_phase debootstrap 1200 \
    debootstrap --variant=minbase --components=main bookworm "$ROOT" "$MIRROR"
fi

# ---------------------------------------------------------------- copy
CURRENT=copy
start=$(date +%s)
echo
echo "== phase copy: the checkout (git ls-files) to $REPO_IN_ROOT"
if [[ -e $ROOT$REPO_IN_ROOT ]]; then rm -rf --one-file-system "${ROOT:?}$REPO_IN_ROOT"; fi
mkdir -p "$ROOT$REPO_IN_ROOT"
list="$LOGDIR/files"
: >"$list"
git -C "$REPO" ls-files -z --cached --others --exclude-standard >"$LOGDIR/ls-files" \
  || fail copy "git ls-files failed in $REPO"
n=0
while IFS= read -r -d '' f; do
  # Tracked files deleted in the working tree are skipped, as are submodules.
  if [[ -L $REPO/$f || -f $REPO/$f ]]; then printf '%s\0' "$f" >>"$list"; n=$((n + 1)); fi
done <"$LOGDIR/ls-files"
[[ $n -gt 0 ]] || fail copy "git ls-files listed no files in $REPO"
tar -C "$REPO" --null -T "$list" -cf - | tar -C "$ROOT$REPO_IN_ROOT" -xf - \
  || fail copy "copying the files with tar failed"
TIME[copy]=$(( $(date +%s) - start ))
RESULT[copy]=PASSED
say "copied $n files"
CURRENT=""

# ---------------------------------------------------------------- mounts
[[ -e $ROOT/usr/local/cuda ]] && say "warning: the root has /usr/local/cuda (reused root?)"
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf"
cat >"$ROOT/etc/apt/sources.list" <<EOF
deb $MIRROR bookworm main
deb $MIRROR bookworm-updates main
deb $SECURITY bookworm-security main
EOF
# No daemon starts in the root (e.g. the prometheus package's service).
printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
chmod 755 "$ROOT/usr/sbin/policy-rc.d"

mkdir -p "$ROOT/proc" "$ROOT/sys" "$ROOT/dev" "$ROOT/root/.cache"
mount -t proc proc "$ROOT/proc" || fail mount "mounting /proc in the root"
mount --bind /sys "$ROOT/sys" || fail mount "bind-mounting /sys in the root"
mount --bind /dev "$ROOT/dev" || fail mount "bind-mounting /dev in the root"
mkdir -p "$ROOT/dev/pts" "$ROOT/dev/shm"
mount --bind /dev/pts "$ROOT/dev/pts" || fail mount "bind-mounting /dev/pts in the root"
mount -t tmpfs -o mode=1777,nosuid,nodev shm "$ROOT/dev/shm" || fail mount "mounting /dev/shm in the root"
if [[ $SHARE_CACHE -eq 1 ]]; then
  home=$HOME
  if [[ -n ${SUDO_USER:-} && $SUDO_USER != root ]]; then
    home=$(getent passwd "$SUDO_USER" | cut -d: -f6) || home=$HOME
  fi
  cache="$home/.cache/shardopt-bazel-disk"
  mkdir -p "$cache" "$ROOT/root/.cache/shardopt-bazel-disk"
  mount --bind "$cache" "$ROOT/root/.cache/shardopt-bazel-disk" \
    || fail mount "bind-mounting the disk cache $cache"
  say "sharing the Bazel disk cache $cache"
fi

# ---------------------------------------------------------------- phases
run_phase setup 2400 "${IN_ROOT[@]}" "cd $REPO_IN_ROOT && tools/setup.sh"
run_phase demo 2400 "${IN_ROOT[@]}" "cd $REPO_IN_ROOT && tools/demo.sh"
# Everything builds without the CUDA toolkit (the root has none): the GPU
# targets are skipped.
run_phase build 2400 "${IN_ROOT[@]}" "cd $REPO_IN_ROOT && bazel build //..."
run_phase tests 1800 "${IN_ROOT[@]}" "cd $REPO_IN_ROOT && bazel test --nocache_test_results $TESTS"

summary
trap - EXIT
cleanup 0
total=0
for p in "${PHASES[@]}"; do total=$((total + ${TIME[$p]:-0})); done
echo "FRESH-MACHINE CHECK PASSED: debootstrap ${TIME[debootstrap]} s, setup ${TIME[setup]} s, demo ${TIME[demo]} s, build ${TIME[build]} s, tests ${TIME[tests]} s (total $(fmt_time "$total"))"
