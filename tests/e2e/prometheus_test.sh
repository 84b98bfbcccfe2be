#!/usr/bin/env bash
# Issue 16 with the real things: Debian's Prometheus server scrapes a 2-rank
# job (shardrun --metrics-port=0, the trainer with one rank slowed on
# purpose), and the test checks through Prometheus' HTTP API that the series
# exist with sane values: steps increase, memory equals shardctl memory --json,
# world size 2, checkpoints, the step-time histogram, the slow rank. promtool
# checks docs/prometheus/ (rules, their unit tests, the scrape config), and
# the real server loads the rules. Every process runs under `timeout`;
# everything listens on 127.0.0.1, on ports the OS chose.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
B=tools
D=docs/prometheus
tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/prom.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  wait 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT

for tool in prometheus promtool python3; do
  if ! command -v "$tool" >/dev/null; then
    echo "FAIL: '$tool' is not installed (tools/setup.sh installs it)"
    exit 1
  fi
done

# 1. The documented files: rules valid, their unit tests pass, the config valid.
check "promtool check rules" timeout 60 promtool check rules "$D/alerts.yml"
check "promtool test rules (alert unit tests)" timeout 60 promtool test rules "$D/alerts_test.yml"
check "promtool check config" timeout 60 promtool check config "$D/prometheus.yml"

# Bad values of the new flags are refused by name (exit 2) before anything starts.
refused() {  # refused 'MESSAGE' COMMAND...: exit status 2 and the message on stderr
  local want=$1; shift
  local out rc
  out=$(timeout 30 "$@" 2>&1 >/dev/null); rc=$?
  [[ $rc -eq 2 && "$out" == *"$want"* ]] || { echo "  got status $rc: $out"; return 1; }
}
check "--metrics-port=65536 refused" refused '--metrics-port must be a port number in [0, 65535]' \
  $B/shardrun --nproc 1 --metrics-port=65536 -- true
check "--slow-factor=1 refused" refused '--slow-factor must be a number in (1, 1000]' \
  $B/shardrun --nproc 1 --slow-factor=1 -- true
check "--slow-factor=nan refused" refused '--slow-factor must be a number' \
  $B/shardrun --nproc 1 --slow-factor=nan -- true
check "--slow-windows=0 refused" refused '--slow-windows must be an integer in [1, 1000]' \
  $B/shardrun --nproc 1 --slow-windows=0 -- true
check "--slow-window=0 refused" refused '--slow-window must be a number of seconds in [0.1, 3600]' \
  $B/shardrun --nproc 1 --slow-window=0 -- true
check "--metrics-port-file alone refused" refused '--metrics-port-file needs --metrics-port' \
  $B/shardrun --nproc 1 --metrics-port-file="$tmp/x" -- true
check "--metrics-port with --coordinator refused" refused '--metrics-port applies to the shardrun that runs the coordinator' \
  $B/shardrun --nproc 1 --coordinator=127.0.0.1:1 --metrics-port=0 -- true
check "--debug-slow-ms=60001 refused" refused '--debug-slow-ms must be an integer in [0, 60000]' \
  $B/shardopt_train --debug-slow-ms=60001
check "--debug-slow-rank=1 of 1 refused" refused '--debug-slow-rank must be an integer in [-1, 0]' \
  $B/shardopt_train --debug-slow-rank=1

# 2. A 2-rank job serving metrics; rank 1 sleeps 150 ms in every step.
timeout 240 $B/shardrun --nproc 2 --port-file="$tmp/addr" --metrics-port=0 \
  --metrics-port-file="$tmp/metrics" --slow-window=2 --slow-windows=3 -- \
  $B/shardopt_train --model=tiny --steps=1000000 --log-every=1000000 \
  --ckpt-dir="$tmp/ck" --ckpt-every=20 --ckpt-keep=2 \
  --debug-slow-rank=1 --debug-slow-ms=150 >"$tmp/run.log" 2>&1 &
run=$!
pids+=("$run")
wait_file "$tmp/metrics" 30
wait_file "$tmp/addr" 30
metrics=$(cat "$tmp/metrics" 2>/dev/null)
addr=$(cat "$tmp/addr" 2>/dev/null)
check "shardrun prints the metrics address" grep -q "^shardrun: metrics on http://$metrics/metrics" "$tmp/run.log"
check "metrics on 127.0.0.1 with an OS-chosen port" bash -c "[[ '$metrics' =~ ^127\.0\.0\.1:[0-9]+$ && '$metrics' != '127.0.0.1:0' ]]"
ctl() { timeout 30 $B/shardctl --coordinator="$addr" "$@"; }
ctl status --wait=120 >/dev/null

# 3. Prometheus: its own config (scrape every second, the documented rules),
# storage and port. A port is picked by the OS and released for Prometheus;
# if something takes it meanwhile, try another.
cat >"$tmp/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - $PWD/$D/alerts.yml
scrape_configs:
  - job_name: shardopt
    static_configs:
      - targets: ["$metrics"]
EOF
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
prom=""
# prom_ready PORT PID: Prometheus answers on PORT (then $prom is set), or its
# process PID is gone (then there is nothing to wait for).
prom_ready() {
  if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$1/-/ready', timeout=2)" 2>/dev/null; then
    prom="127.0.0.1:$1"
    return 0
  fi
  ! kill -0 "$2" 2>/dev/null
}
for attempt in 1 2 3; do
  port=$(free_port)
  timeout 200 prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/tsdb.$attempt" \
    --web.listen-address="127.0.0.1:$port" --log.level=warn >"$tmp/prometheus.$attempt.log" 2>&1 &
  pids+=("$!")
  wait_until 30 "Prometheus ready on port $port" prom_ready "$port" "${pids[-1]}"
  [[ -n "$prom" ]] && break
done
check "prometheus started" test -n "$prom"
[[ -n "$prom" ]] || { cat "$tmp"/prometheus.*.log; exit 1; }

# q EXPR: the value of the query's one sample ("none" when there is no sample,
# "many" when there are several).
cat >"$tmp/q.py" <<'EOF'
import json, sys, urllib.parse, urllib.request
url = "http://%s/api/v1/query?%s" % (sys.argv[1], urllib.parse.urlencode({"query": sys.argv[2]}))
r = json.load(urllib.request.urlopen(url, timeout=10))
res = r["data"]["result"] if r.get("status") == "success" else []
print("none" if not res else "many" if len(res) > 1 else res[0]["value"][1])
EOF
q() { timeout 20 python3 "$tmp/q.py" "$prom" "$1"; }
# has_value EXPR: the query has a value now; wait_for EXPR: until it has one
# (at most 60 s).
has_value() {
  local v
  v=$(q "$1")
  [[ "$v" != none && -n "$v" ]]
}
wait_for() { wait_until 60 "a value of the query $1" has_value "$1"; }
# num A OP B: a comparison of two numeric Python expressions (Prometheus'
# NaN and +Inf are numbers; "none" or "many" fail).
num() {
  python3 -c "import sys, math; NaN = float('nan'); Inf = float('inf'); a = ($1); b = ($3)
sys.exit(0 if math.isfinite(a) and a $2 b else 1)" 2>/dev/null
}

check "prometheus scraped the target" wait_for 'up{job="shardopt"} == 1'
check "rank series exist" wait_for 'shardopt_rank_memory_bytes{rank="1",role="state"}'
check "both ranks report steps" test "$(q 'count(shardopt_rank_step)')" = 2
check "world size 2" test "$(q 'shardopt_job_world_size')" = 2
check "job state running" test "$(q 'shardopt_job_state{state="running"}')" = 1
check "job state: one state at 1" test "$(q 'sum(shardopt_job_state)')" = 1
check "job info names the job" test "$(q 'shardopt_job_info{job_id="job"}')" = 1

# Steps increase between two queries (the second once Prometheus has scraped
# the increase: at most 30 s).
s1=$(q 'shardopt_rank_step{rank="0"}')
j1=$(q 'shardopt_job_step')
b1=$(q 'shardopt_rank_sent_bytes_total{rank="1"}')
increased() {
  s2=$(q 'shardopt_rank_step{rank="0"}')
  j2=$(q 'shardopt_job_step')
  b2=$(q 'shardopt_rank_sent_bytes_total{rank="1"}')
  num "$s2" '>' "$s1" && num "$j2" '>' "$j1" && num "$b2" '>' "$b1"
}
wait_until 30 "the steps and bytes sent to increase in Prometheus" increased
echo "rank 0 step $s1 -> $s2, job step $j1 -> $j2, rank 1 sent bytes $b1 -> $b2"
check "rank step increases" num "$s2" '>' "$s1"
check "job step increases" num "$j2" '>' "$j1"
check "bytes sent increase" num "$b2" '>' "$b1"

# Memory equals shardctl memory --json for the same rank (RSS: within 20%,
# it moves between the heartbeat and the query).
ctl memory --json >"$tmp/memory.json"
for r in 0 1; do
  for pair in master:masterBytes state:stateBytes gradients:gradBytes parameters:paramBytes; do
    role=${pair%%:*}
    field=${pair#*:}
    want=$(python3 -c "import json; print(next(x for x in json.load(open('$tmp/memory.json'))['ranks'] if x['rank']==$r)['$field'])")
    got=$(q "shardopt_rank_memory_bytes{rank=\"$r\",role=\"$role\"}")
    check "rank $r memory $role: prometheus $got = shardctl $want" num "$got" '==' "$want"
  done
  want=$(python3 -c "import json; print(next(x for x in json.load(open('$tmp/memory.json'))['ranks'] if x['rank']==$r)['rssBytes'])")
  got=$(q "shardopt_rank_memory_bytes{rank=\"$r\",role=\"rss\"}")
  check "rank $r memory rss: prometheus $got ~ shardctl $want" num "abs($got - $want)" '<=' "0.2 * $want"
done
check "state memory is not zero" num "$(q 'shardopt_rank_memory_bytes{rank="0",role="state"}')" '>' 0

# The rest of the per-rank series, with sane values.
for r in 0 1; do
  check "rank $r samples/s > 0" num "$(q "shardopt_rank_samples_per_second{rank=\"$r\"}")" '>' 0
  check "rank $r loss finite" num "$(q "shardopt_rank_loss{rank=\"$r\"}")" '>=' 0
  check "rank $r grad norm > 0" num "$(q "shardopt_rank_grad_norm{rank=\"$r\"}")" '>' 0
  check "rank $r comm wait >= 0" num "$(q "shardopt_rank_comm_wait_seconds{rank=\"$r\"}")" '>=' 0
  check "rank $r update time > 0" num "$(q "shardopt_rank_update_seconds{rank=\"$r\"}")" '>' 0
  check "rank $r heartbeat age < 5 s" num "$(q "shardopt_rank_heartbeat_age_seconds{rank=\"$r\"}")" '<' 5
  check "rank $r no stalls" test "$(q "shardopt_rank_stalls_total{rank=\"$r\"}")" = 0
  check "rank $r step-time histogram counts steps" num "$(q "shardopt_rank_step_seconds_count{rank=\"$r\"}")" '>' 0
  # Every step sleeps 150 ms on rank 1 and everyone waits for it.
  check "rank $r median step time from the histogram >= 0.1 s" \
    num "$(q "histogram_quantile(0.5, rate(shardopt_rank_step_seconds_bucket{rank=\"$r\"}[30s]))")" '>=' 0.1
done

# Checkpoints (every 20 steps): rank 0's count, step, bytes, time.
check "a checkpoint was taken" wait_for 'shardopt_checkpoints_total >= 1'
ck_step=$(q 'shardopt_last_checkpoint_step')
check "last checkpoint step $ck_step is a multiple of 20" python3 -c "import sys; v=int(float('$ck_step')); sys.exit(0 if v > 0 and v % 20 == 0 else 1)"
ck_bytes=$(q 'shardopt_last_checkpoint_bytes')
disk=$(du -sb "$tmp/ck/step-$(python3 -c "print(int(float('$ck_step')))")" 2>/dev/null | cut -f1)
echo "last checkpoint: step $ck_step, $ck_bytes bytes (on disk: ${disk:-gone} bytes with the directory)"
check "last checkpoint bytes > 0" num "$ck_bytes" '>' 0
check "last checkpoint duration > 0" num "$(q 'shardopt_last_checkpoint_duration_seconds')" '>' 0
check "last checkpoint less than a minute ago" num "$(q 'time() - shardopt_last_checkpoint_timestamp_seconds')" '<' 60
check "job duration > 0" num "$(q 'shardopt_job_duration_seconds')" '>' 0
check "no aborts" test "$(q 'sum(shardopt_job_aborts_total)')" = 0

# 4. The slowed rank is named: one line on shardrun's output, the metric,
# shardctl status --json; the fast rank is not.
wait_until 60 "shardrun to name rank 1 slow" grep -q '^shardrun: rank 1 is slow: ' "$tmp/run.log"
check "shardrun names rank 1 slow" grep -q '^shardrun: rank 1 is slow: busy time per step (step time minus waiting on collectives) p50 .* the median of the others (.*), 3 windows of 2 s in a row$' "$tmp/run.log"
grep '^shardrun: rank' "$tmp/run.log"
check "slow metric of rank 1" wait_for 'shardopt_rank_slow{rank="1"} == 1'
check "rank 0 is not slow" test "$(q 'shardopt_rank_slow{rank="0"}')" = 0
check "one slow rank" test "$(q 'shardopt_job_slow_ranks')" = 1
check "rank 1 busy time >= 0.15 s" num "$(q 'shardopt_rank_busy_seconds{rank="1"}')" '>=' 0.15
check "the alert rule sees it" wait_for 'shardopt_rank_busy_seconds > on(job, instance) group_left 1.5 * quantile by (job, instance) (0.5, shardopt_rank_busy_seconds)'
ctl status --json >"$tmp/status.json"
check "status --json: slowRanks [1]" python3 -c "
import json; d=json.load(open('$tmp/status.json'))
assert d['slowRanks'] == [1], d['slowRanks']
r = {x['rank']: x for x in d['ranks']}
assert r[1]['slow'] and 'the median of the others' in r[1]['slowReason'], r[1]
assert not r[0]['slow']
assert r[1]['stepSecondsP50'] >= 0.1 and r[1]['stepSecondsMax'] >= r[1]['stepSecondsP50'], r[1]
assert int(r[0]['metrics']['stateBytes']) > 0
assert d['durationSeconds'] > 0"

# The real server loaded the documented rules.
check "prometheus loaded the 3 alert rules" python3 -c "
import json, urllib.request
g = json.load(urllib.request.urlopen('http://$prom/api/v1/rules', timeout=10))['data']['groups']
names = sorted(r['name'] for x in g for r in x['rules'])
assert names == ['ShardoptCheckpointTooOld', 'ShardoptNoStep', 'ShardoptSlowRank'], names
assert all(r['health'] == 'ok' for x in g for r in x['rules']), g"

# 5. Done: abort, shardrun fails and says why; the slow line came once.
ctl abort "prometheus test done" >/dev/null
wait "$run"
rc=$?
check "aborted job exits 1" test $rc -eq 1
check "one 'is slow' line" test "$(grep -c '^shardrun: rank 1 is slow' "$tmp/run.log")" = 1

if [[ $fails -ne 0 ]]; then
  echo "--- shardrun output (last 40 lines)"
  tail -40 "$tmp/run.log"
  echo "--- prometheus"
  cat "$tmp"/prometheus.*.log
fi
echo "$fails failed"
[[ $fails -eq 0 ]]
