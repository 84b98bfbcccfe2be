#!/usr/bin/env bash
# Soak run: the 2-rank CPU training job for a fixed number of steps while
# shardctl hammers the read-only RPCs, with checkpoints every K steps and one
# forced kill -9 of a rank in the middle, then resume. Reports steps lost
# (must be only those after the last committed checkpoint), the final
# parameters against an uninterrupted run (compared through consolidated
# checkpoints), the slowdown under query load, and RSS growth over the run.
#   tools/soak.sh [STEPS] [CKPT_EVERY] [MODEL]
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-60}; every=${2:-10}; model=${3:-mlp}
bazel build -c opt //tools:shardrun //tools:shardopt_train //tools:shardctl 2>&1 | tail -n 1
B=bazel-bin/tools
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT
train() {  # train NAME [flags]: runs the job, leaves its coordinator address in $tmp/NAME.addr
  local name=$1; shift
  $B/shardrun --nproc 2 --port-file "$tmp/$name.addr" -- $B/shardopt_train --model="$model" \
    --steps="$steps" --log-every=1 "$@" >"$tmp/$name.log" 2>&1
}
secs() { sed -n 's/.*done: [0-9]* steps in \([0-9.]*\) s.*/\1/p' "$1"; }

echo "1. uninterrupted run, $steps steps, checkpoint every $every"
train ref --ckpt-dir="$tmp/ref" --ckpt-every="$every" || { echo "reference run failed"; exit 1; }

echo "2. the same job under shardctl load (50 queries/s), killed with -9 mid-run"
train soak --ckpt-dir="$tmp/soak" --ckpt-every="$every" &
run=$!
for _ in $(seq 1 300); do [[ -s "$tmp/soak.addr" ]] && break; sleep 0.1; done
addr=$(cat "$tmp/soak.addr")
$B/shardctl --coordinator="$addr" status --wait=60 >/dev/null
rss() { $B/shardctl --coordinator="$addr" memory --json 2>/dev/null |
        python3 -c "import json,sys; print(sum(int(r.get('rssBytes',0)) for r in json.load(sys.stdin)['ranks']))"; }
$B/shardctl --coordinator="$addr" load --rate=50 --duration=100000 >"$tmp/load.txt" 2>&1 &
at_step() {  # wait until the job has done $1 steps
  while :; do
    s=$($B/shardctl --coordinator="$addr" status --json 2>/dev/null | python3 -c "import json,sys; print(int(json.load(sys.stdin).get('step',0)))" 2>/dev/null || echo 0)
    [[ $s -ge $1 ]] && return
    sleep 0.2
  done
}
# RSS after warm-up and a first checkpoint, and again twice as far in; then
# kill a rank.
at_step $(( steps / 4 )); rss_start=$(rss); rss_start_step=$s
at_step $(( steps / 2 )); rss_mid=$(rss)
killed_at=$s
victim=$(for p in $(pgrep -f shardopt_train); do
  tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -x "RANK=1" >/dev/null &&
  tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -x "SHARDOPT_COORDINATOR=$addr" >/dev/null && echo $p; done)
kill -9 $victim
wait $run
killed_at=$(grep -o 'step [0-9]*/' "$tmp/soak.log" | tail -n 1 | tr -dc '0-9')
latest=$(cat "$tmp/soak/LATEST")
saved=${latest#step-}
echo "   killed rank 1 after step $killed_at; last committed checkpoint: $latest"
echo "3. resume from it"
train resumed --ckpt-dir="$tmp/soak" --ckpt-every="$every" --resume="$tmp/soak" || { echo "resume failed"; exit 1; }
grep -o 'resumed from .*' "$tmp/resumed.log" | sed -n 1p | sed 's/^/   /'
$B/shardctl consolidate "$tmp/ref" "$tmp/ref.safetensors" >/dev/null 2>&1
$B/shardctl consolidate "$tmp/soak" "$tmp/soak.safetensors" >/dev/null 2>&1
if cmp -s "$tmp/ref.safetensors" "$tmp/soak.safetensors"; then same="bitwise identical"; else same="DIFFERENT"; fi
echo
echo "steps lost to the kill: $(( killed_at - saved )) (the steps after checkpoint $latest; checkpoints every $every)"
echo "final parameters and optimizer state vs the uninterrupted run: $same"
echo "query load: $(tail -n 1 "$tmp/load.txt")"
echo "uninterrupted: $(secs "$tmp/ref.log") s for $steps steps; resumed part under no load: $(secs "$tmp/resumed.log") s for $(( steps - saved )) steps"
echo "RSS of both ranks together: $(( rss_start / 1048576 )) MiB at step $rss_start_step, $(( rss_mid / 1048576 )) MiB at step $s (under query load, with checkpoints every $every)"
[[ $same == "bitwise identical" ]]
