#!/usr/bin/env bash
# shardctl top in a real terminal: a 2-rank job served over TLS with a token,
# `shardctl top` running in detached tmux sessions of given sizes. Checks the
# frame (header, a line per rank, the slowest highlighted), that it redraws on
# a resize (SIGWINCH: wider shows what a narrower one cut, a lower one
# summarizes ranks), that it keeps refreshing with a one-line status when the
# coordinator goes away, that q and Ctrl-C end it and leave the terminal as it
# was (stty settings, cursor, main screen); and `top --once` for scripts.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
B=tools
if ! command -v tmux >/dev/null 2>&1; then
  echo "SKIPPED: tmux is not installed (tools/setup.sh installs it)"
  exit 0
fi
tmp=$(mktemp -d)
# tmux's socket path must stay short (sun_path): its own directory under /tmp.
sockdir=$(mktemp -d /tmp/sctop.XXXXXX 2>/dev/null || mktemp -d)
export TMUX_TMPDIR=$sockdir
unset TMUX
sock="shardctl-top-$$-$RANDOM"
T() { timeout 10 tmux -L "$sock" -f /dev/null "$@"; }
cleanup() {
  T kill-server >/dev/null 2>&1
  kill $(jobs -p) 2>/dev/null
  rm -rf "$tmp" "$sockdir"
}
trap cleanup EXIT
cap() { T capture-pane -p -t "$1"; }        # the pane's text
cape() { T capture-pane -p -e -t "$1"; }    # with escape sequences (attributes)
pane_shows() { cap "$1" | grep -Eq -- "$2"; }
wait_pane() {  # wait_pane SESSION EGREP SECONDS: until the pane shows a line matching
  wait_until "$3" "pane $1 to show /$2/" pane_shows "$1" "$2"
}
no_wider() { awk -v w="$1" 'length($0) > w { bad = 1 } END { exit bad }'; }

# Certificates for TLS (CA, server certificate for 127.0.0.1), and a token.
(
  cd "$tmp" &&
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=test-ca &&
  openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1 &&
  printf 'subjectAltName=IP:127.0.0.1,DNS:localhost' >san.ext &&
  openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 \
    -extfile san.ext
) >"$tmp/openssl.log" 2>&1 || { cat "$tmp/openssl.log"; echo "FAIL openssl"; exit 1; }
echo "top-secret" >"$tmp/token"

# A 2-rank job that runs until aborted (at most 300 s).
SHARDOPT_TLS_CA="$tmp/ca.pem" timeout 300 $B/shardrun --nproc 2 --job-id=topjob --port-file="$tmp/addr" \
  --token-file="$tmp/token" --tls-cert="$tmp/server.pem" --tls-key="$tmp/server.key" -- \
  $B/shardopt_train --model=tiny --steps=100000000 --log-every=100000000 >"$tmp/run.log" 2>&1 &
run=$!
wait_file "$tmp/addr" 30
addr=$(cat "$tmp/addr")
ctl=("$PWD/$B/shardctl" --coordinator="$addr" --tls-ca="$tmp/ca.pem" --token-file="$tmp/token")
timeout 60 "${ctl[@]}" status --wait=60 >"$tmp/status.txt" 2>&1
check "job running" grep -q 'running, 2 ranks' "$tmp/status.txt"
# Memory is read from the ranks' shard-owner services, which serve TLS too.
timeout 30 "${ctl[@]}" memory --json >"$tmp/mem.json" 2>&1
check "memory through the ranks' TLS shard owners" python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['ranks']; sys.exit(0 if len(r)==2 and all(not x.get('error') and int(x.get('stateBytes',0))>0 for x in r) else 1)" "$tmp/mem.json"
# A heartbeat or two with step times from every rank.
step_times() {
  timeout 30 "${ctl[@]}" status --json 2>/dev/null | python3 -c "import json,sys; r=json.load(sys.stdin)['ranks']; sys.exit(0 if len(r)==2 and all(float(x.get('stepSecondsP50',0))>0 for x in r) else 1)" 2>/dev/null
}
wait_until 30 "step times in both ranks' heartbeats" step_times

# --once: one plain frame, no terminal control.
timeout 30 "${ctl[@]}" top --once >"$tmp/once.txt" 2>&1
rc=$?
cat "$tmp/once.txt"
check "once: exit 0" test $rc -eq 0
check "once: header" grep -Eq '^job topjob  running  2 ranks  step [0-9]+  lr 0.0001  up [0-9]+s  slow ranks: ' "$tmp/once.txt"
check "once: column header" grep -Eq '^ rank +step +t p50 +t max +samp/s +comm +optim +memory +hb age +note$' "$tmp/once.txt"
check "once: a line per rank" test "$(grep -Ec '^[ *!] +[01] +[0-9]+ ' "$tmp/once.txt")" -eq 2
check "once: no escape sequences" test "$(tr -d -c '\033' <"$tmp/once.txt" | wc -c)" -eq 0
# (memory: RSS from the heartbeats, "-" from a trainer that does not report it)
check "once: memory and heartbeat age" grep -Eq '^[ *!] +0 .*( MiB| -) +[0-9.]+s' "$tmp/once.txt"
timeout 30 "$PWD/$B/shardctl" --coordinator="$addr" --tls-ca="$tmp/ca.pem" top --once >"$tmp/notoken.txt" 2>&1
rc=$?
check "once without the token: non-zero, one line" test $rc -ne 0 -a "$(wc -l <"$tmp/notoken.txt")" -eq 1
check "once without the token: says so" grep -q 'bearer token' "$tmp/notoken.txt"
timeout 30 "$PWD/$B/shardctl" --coordinator=127.0.0.1:1 top --once >"$tmp/unreach.txt" 2>&1
rc=$?
check "once, unreachable: exit 2, one line" test $rc -eq 2 -a "$(wc -l <"$tmp/unreach.txt")" -eq 1
check "once, unreachable: names it" grep -q '^shardctl: status: cannot reach the coordinator (.*) \[127.0.0.1:1\]$' "$tmp/unreach.txt"
timeout 30 "${ctl[@]}" top --once --interval=0 >"$tmp/badflag.txt" 2>&1
rc=$?
check "--interval=0 refused (exit 2)" test $rc -eq 2
check "--interval range named" grep -q -- '--interval must be a number of seconds in \[0.1, 3600\]' "$tmp/badflag.txt"

# The pane runs a script (no interactive shell: nothing between shardctl and
# the terminal) that records the terminal's settings before and after.
pane_script() {  # pane_script NAME INTERVAL
  cat >"$tmp/$1.sh" <<SH
#!/bin/sh
trap : INT
stty -g >"$tmp/$1.before"
timeout --foreground 120 ${ctl[*]} top --interval=$2
rc=\$?
# Settings first, then the exit status the test waits for (the other order
# raced: the test could compare before the settings were written).
stty -g >"$tmp/$1.after"
echo \$rc >"$tmp/$1.rc"
exec sleep 600  # on purpose: the pane (and its screen) stays until the test ends it
SH
  chmod +x "$tmp/$1.sh"
}

# A. --interval=3600: after the first fetch only a resize redraws. Starts
# 50 columns wide (the header is cut), grows to 120 (the rest appears).
pane_script a 3600
T new-session -d -s a -x 50 -y 12 "$tmp/a.sh"
check "A: frame drawn" wait_pane a '^[ *!] +1 +[0-9]+ ' 30
cap a >"$tmp/a1.txt"
cat "$tmp/a1.txt"
check "A: header cut to 50 columns" grep -Eq '^job topjob  running  2 ranks  step [0-9]+' "$tmp/a1.txt"
check "A: no line wider than 50" no_wider 50 <"$tmp/a1.txt"
check "A: cut part not shown" bash -c "! grep -q 'slow ranks' '$tmp/a1.txt'"
check "A: alternate screen, cursor hidden" test "$(T display -p -t a '#{alternate_on}#{cursor_flag}')" = 10
T resize-window -t a -x 120 -y 12
check "A: redrawn at 120 columns (SIGWINCH)" wait_pane a 'slow ranks: ' 5
cap a >"$tmp/a2.txt"
cat "$tmp/a2.txt"
check "A: notes column at 120" grep -Eq '^ rank .* hb age  note$' "$tmp/a2.txt"
T send-keys -t a C-c
check "A: Ctrl-C ends it" wait_file "$tmp/a.rc" 5
check "A: exit status 130" test "$(cat "$tmp/a.rc" 2>/dev/null)" = 130
check "A: terminal settings restored" cmp -s "$tmp/a.before" "$tmp/a.after"
check "A: main screen, cursor shown" test "$(T display -p -t a '#{alternate_on}#{cursor_flag}')" = 01

# B. --interval=0.5 at 120x12: the live view refreshes; the slowest rank is
# highlighted; a low window summarizes; q quits.
pane_script b 0.5
T new-session -d -s b -x 120 -y 12 "$tmp/b.sh"
check "B: frame drawn" wait_pane b '^[ *!] +1 +[0-9]+ ' 30
cap b >"$tmp/b1.txt"
cat "$tmp/b1.txt"
check "B: header" grep -Eq '^job topjob  running  2 ranks  step [0-9]+  lr 0.0001  up [0-9]+s  slow ranks: (none|[0-9,]+)$' "$tmp/b1.txt"
check "B: a line per rank" test "$(grep -Ec '^[ *!] +[01] +[0-9]+ ' "$tmp/b1.txt")" -eq 2
step1=$(grep -Eo 'step [0-9]+' "$tmp/b1.txt" | sed -n 1p | cut -d' ' -f2)
later_step() {
  step2=$(cap b | grep -Eo 'step [0-9]+' | sed -n 1p | cut -d' ' -f2)
  [[ "${step2:-0}" -gt "${step1:-0}" ]]
}
wait_until 10 "pane b to show a step after $step1" later_step
check "B: refreshes (step $step1 -> $step2)" test "${step2:-0}" -gt "${step1:-0}"
# The slowest rank ('*', when the ranks' step times differ) is the one line in reverse video.
found=""
slowest_marked() { cape b >"$tmp/b2.txt" && grep -Eq $'^(\033\\[7m)?\\*' "$tmp/b2.txt"; }
wait_until 6 "pane b to mark a slowest rank" slowest_marked && found=1
if [[ -n $found ]]; then
  check "B: slowest in reverse video" test "$(grep -c $'^\033\\[7m\\*' "$tmp/b2.txt")" -eq 1
  check "B: no other marked line" test "$(grep -c '^\*' "$tmp/b2.txt")" -eq 0
else
  echo "NOTE B: no slowest rank named in 6 s (the ranks' step times were equal)"
fi
T resize-window -t b -x 60 -y 3
check "B: redrawn at 60x3: ranks summarized" wait_pane b '^\.\.\. 2 more ranks$' 5
cap b >"$tmp/b3.txt"
cat "$tmp/b3.txt"
check "B: no line wider than 60" no_wider 60 <"$tmp/b3.txt"
check "B: 3 rows" test "$(grep -c . "$tmp/b3.txt")" -eq 3
T resize-window -t b -x 120 -y 12
# The coordinator goes away: the view stays, with a one-line status.
timeout 30 "${ctl[@]}" abort "shardctl top test done" >/dev/null
wait $run
check "B: keeps running, says the coordinator is unreachable" \
  wait_pane b "^error from $addr, retrying every 0.5s \(data from [0-9]+s ago\): status: cannot reach the coordinator" 10
cap b >"$tmp/b4.txt"
cat "$tmp/b4.txt"
check "B: still showing the last data" grep -Eq '^job topjob ' "$tmp/b4.txt"
check "B: still running" test ! -e "$tmp/b.rc"
T send-keys -t b q
check "B: q ends it" wait_file "$tmp/b.rc" 3
check "B: exit status 0" test "$(cat "$tmp/b.rc" 2>/dev/null)" = 0
check "B: terminal settings restored" cmp -s "$tmp/b.before" "$tmp/b.after"
check "B: main screen, cursor shown" test "$(T display -p -t b '#{alternate_on}#{cursor_flag}')" = 01
check "B: the frame is gone from the screen" bash -c "! timeout 10 tmux -L '$sock' capture-pane -p -t b | grep 'hb age' >/dev/null"
check "no shardctl left" test -z "$(pgrep -f -- "--tls-ca=$tmp/ca.pem" || true)"

echo "$fails failed"
exit $(( fails > 0 ))
