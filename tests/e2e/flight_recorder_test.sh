#!/usr/bin/env bash
# Flight recorder end to end, with the real binaries (README, "Flight recorder"):
# (a) a rank that stalls in collectives while heartbeating: shardrun's output
#     names it and the collective the others waited in;
# (b) kill -9 of one rank mid-run: the output says which ranks failed in which
#     collective and that rank 1 sent no record;
# (c) shardctl flight-recorder on a live job: both ranks' rings, increasing
#     sequence numbers that mean the same collective on both ranks;
# (d) the coordinator gone (launcher killed): the rings land as JSON next to
#     the checkpoints.
# Every process runs under timeout; everything listens on 127.0.0.1, port 0.
set -uo pipefail
source tests/testing/lib.sh || exit 1  # (tests run from the workspace root)
B=tools
tmp=$(mktemp -d)
id=${tmp##*.}  # job ids unique to this run (rank_pid finds ranks by job id)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT

# (a) Rank 1 of 3 stops taking part before step 6 (index 5) while its
# heartbeats go on; the others time out after 2 s. (A step's collectives, with
# the gathers overlapping the next forward: reduce-scatters, the per-step
# agreement, the norm, then the all-gathers first layers first, so a step
# ends with the all-gather of bucket 0.)
timeout 120 $B/shardrun --nproc 3 --job-id=stall_$id -- $B/shardopt_train --model=tiny --steps=1000 \
  --collective-timeout=2 --debug-stall-rank=1 --debug-stall-step=5 >"$tmp/stall.log" 2>&1
rc=$?
check "stall: job fails" test $rc -eq 1
grep '^shardrun: flight recorder: ' "$tmp/stall.log" >"$tmp/stall.line"
check "stall: one divergence line" test "$(wc -l <"$tmp/stall.line")" -eq 1
check "stall: names the waiting ranks, the collective and the stalled rank" grep -Eq \
  '^shardrun: flight recorder: step 6: ranks 0, 2 waited in reduce-scatter of bucket 0 \(seq [0-9]+\) and failed after [0-9.]+ s; rank 1 never started it \(last: all-gather of bucket 0, seq [0-9]+, finished [0-9.]+ s ago\)$' \
  "$tmp/stall.line"
# The seq rank 1 never started is the one after its last.
seqs=$(sed -E 's/.*\(seq ([0-9]+)\).*seq ([0-9]+), finished.*/\1 \2/' "$tmp/stall.line")
check "stall: rank 1's last collective is the one before ($seqs)" test "$(echo "$seqs" | awk '{print $1 - $2}')" = 1

# (b) kill -9 rank 1 of 3 mid-run.
timeout 120 $B/shardrun --nproc 3 --job-id=fr_kill9_$id --heartbeat-timeout=3 --port-file "$tmp/addr9" -- \
  $B/shardopt_train --model=small --steps=1000000 --log-every=100000 >"$tmp/kill.log" 2>&1 &
run=$!
wait_file "$tmp/addr9"
timeout 60 $B/shardctl --coordinator="$(cat "$tmp/addr9")" status --wait=60 >/dev/null
# Mid-run: every rank has heartbeated a step (the output names rank 1's last).
wait_until 30 "job fr_kill9 past step 2" job_past_step "$(cat "$tmp/addr9")" 2
# The rank's process carries RANK only once exec'd (a forked child still
# shows shardrun's command line and environment): look until it is there.
victim=""
found_victim() { victim=$(rank_pid fr_kill9_$id 1); [[ -n $victim ]]; }
wait_until 30 "rank 1's process (exec'd)" found_victim
if [[ -z $victim ]]; then
  echo "could not find rank 1's process; shardopt_train processes:"
  for p in $(pgrep -f shardopt_train); do echo "  $p: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-120)"; done
  kill "$run" 2>/dev/null
fi
start=$(date +%s)
kill -9 "$victim"
wait $run
rc=$?
took=$(( $(date +%s) - start ))
check "kill -9: job fails" test $rc -eq 1
check "kill -9: over within 15 s ($took s)" test $took -le 15
grep '^shardrun: flight recorder: ' "$tmp/kill.log" >"$tmp/kill.line"
check "kill -9: one divergence line" test "$(wc -l <"$tmp/kill.line")" -eq 1
check "kill -9: rank 1 sent no record, with its last heartbeat" grep -Eq \
  'rank 1 sent no record \(dead\? last heartbeat [0-9.]+ s ago, at step [0-9]+\)' "$tmp/kill.line"
# Where the survivors were: in (or done with) the collective that failed, or
# in none (then their last one is named).
check "kill -9: says where the survivors were" grep -Eq \
  -e '^shardrun: flight recorder: step [0-9]+: ranks? [0-9, ]+ (waits?|waited|finished) (in )?[a-z-]+( of bucket [0-9]+)? \(seq [0-9]+.*rank 1 sent no record' \
  -e '^shardrun: flight recorder: step [0-9]+: rank 1 sent no record .*; ranks 0, 2 are in no collective \(last: [a-z-]+' \
  "$tmp/kill.line"

# (c) A live job: shardctl flight-recorder shows both rings.
timeout 120 $B/shardrun --nproc 2 --job-id=fr_live_$id --port-file "$tmp/addr" -- \
  $B/shardopt_train --model=tiny --steps=1000000 --log-every=100000 >"$tmp/live.log" 2>&1 &
run=$!
wait_file "$tmp/addr"
ctl() { timeout 30 $B/shardctl --coordinator="$(cat "$tmp/addr")" "$@"; }
ctl status --wait=60 >/dev/null
# Until both rings hold 10 collectives, 10 of them the same (what the checks
# below look at).
rings_filled() {
  ctl flight-recorder --json 2>/dev/null | python3 -c "
import json, sys
recs = {r['rank']: {int(x['seq']) for x in r['records']} for r in json.load(sys.stdin)['records']}
sys.exit(0 if sorted(recs) == [0, 1] and len(recs[0] & recs[1]) >= 10 else 1)" 2>/dev/null
}
wait_until 30 "10 collectives in both ranks' rings" rings_filled
ctl flight-recorder >"$tmp/fr.txt"
check "live: table for rank 0" grep -q '^rank 0: [0-9]* collectives in its ring' "$tmp/fr.txt"
check "live: table for rank 1" grep -q '^rank 1: [0-9]* collectives in its ring' "$tmp/fr.txt"
check "live: divergence line" grep -q '^divergence: ' "$tmp/fr.txt"
check "live: at most 20 rows per rank" test "$(grep -cE '^ +[0-9]+ +[0-9]+  (reduce_scatter|all_gather|all_reduce|broadcast|barrier) ' "$tmp/fr.txt")" -le 40
ctl flight-recorder --json >"$tmp/fr.json"
check "live: both rings, increasing seq, same collective for the same seq on both ranks" python3 - "$tmp/fr.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
recs = {r["rank"]: r["records"] for r in d["records"]}
assert sorted(recs) == [0, 1], recs.keys()
by_seq = []
for rank, rs in recs.items():
    seqs = [int(r["seq"]) for r in rs]
    assert len(seqs) >= 10, (rank, len(seqs))
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), (rank, seqs[:5])
    for r in rs:
        assert r["op"] in ("reduce_scatter", "all_gather", "all_reduce", "broadcast", "barrier"), r
        assert r["state"] in ("running", "done", "failed"), r
        assert float(r["startUnix"]) > 1.6e9, r
    by_seq.append({int(r["seq"]): (r["op"], r["bucket"], r["bytes"], r["step"]) for r in rs})
common = set(by_seq[0]) & set(by_seq[1])
assert len(common) >= 10, len(common)
for s in common:
    assert by_seq[0][s] == by_seq[1][s], (s, by_seq[0][s], by_seq[1][s])
assert any(v[0] == "reduce_scatter" and v[1] == 0 for v in by_seq[0].values())
assert "divergence" in d
PY
ctl flight-recorder --json --rank=1 >"$tmp/fr1.json"
check "live: --rank=1 shows rank 1 only" python3 -c \
  "import json; d=json.load(open('$tmp/fr1.json')); assert [r['rank'] for r in d['records']] == [1]"
ctl flight-recorder --rank=7 >/dev/null 2>"$tmp/fr7.txt"
check "live: --rank out of range refused" grep -q 'the job has 2 ranks' "$tmp/fr7.txt"
ctl abort "enough" >/dev/null
wait $run
check "live: aborted" test $? -eq 1
check "live: abort shows where every rank was" grep -Eq '^shardrun: flight recorder: (no divergence|step [0-9]+: )' "$tmp/live.log"

# (d) No coordinator to report to: kill -9 the launcher (and its coordinator);
# every rank writes its ring next to the checkpoints.
timeout 120 $B/shardrun --nproc 2 --job-id=fr_norun_$id --port-file "$tmp/addrk" -- \
  $B/shardopt_train --model=tiny --steps=1000000 --log-every=100000 --ckpt-dir="$tmp/ck" >"$tmp/norun.log" 2>&1 &
run=$!
wait_file "$tmp/addrk"
timeout 60 $B/shardctl --coordinator="$(cat "$tmp/addrk")" status --wait=60 >/dev/null
launcher=$(pgrep -P $run -f shardrun)  # (under timeout)
kill -9 "$launcher"
wait $run 2>/dev/null
check "no coordinator: ranks stopped" wait_until 15 "the ranks of job fr_norun to exit" \
  no_ranks fr_norun_$id 0 1
for r in 0 1; do
  check "no coordinator: rank $r's ring in $tmp/ck" python3 -c "
import json; d = json.load(open('$tmp/ck/flight-record-rank-$r.json'))
assert d['rank'] == $r and len(d['records']) > 0 and d['reason'], d.get('reason')"
done

if [[ $fails -ne 0 ]]; then
  echo "---- logs"; tail -n 15 "$tmp"/*.log
  exit 1
fi
