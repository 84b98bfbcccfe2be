#!/usr/bin/env bash
# The one hyper-parameter rule (common/hyper_params.h) on the Python and the
# binaries' paths, with the shared table tests/fixtures/hyper_parameters.tsv:
#  - Python: the ShardedOptimizer constructor and param_groups edits
#    (tests/python/hyper_params_test.py);
#  - shardopt_train --lr / --clip: a bad value is refused by the flag's name
#    (exit 2), a good one gets past the flags (to the missing coordinator);
#  - shardctl set-lr: the rule for a change to a running job (the table's last
#    column), checked before anything is sent.
set -uo pipefail
table=tests/fixtures/hyper_parameters.tsv
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
pass() { echo "PASS $*"; }
fail() { echo "FAIL $*"; fails=$((fails + 1)); }

PYTHONPATH=$PWD/python timeout 300 /usr/bin/python3 tests/python/hyper_params_test.py "$table" ||
  fails=$((fails + 1))

# expect NAME OK TEXT CMD...: CMD's stderr names TEXT iff the value is refused.
expect() {
  local name=$1 ok=$2 text=$3; shift 3
  timeout 60 "$@" >"$tmp/out" 2>"$tmp/err" </dev/null
  local rc=$? last
  last=$(tail -n 1 "$tmp/err")
  if grep -qF -- "$text" "$tmp/err"; then
    if [[ $ok == bad && $rc -ne 0 ]]; then pass "$name refused: $last"; else fail "$name: refused (exit $rc) but the table says $ok: $last"; fi
  else
    if [[ $ok == ok ]]; then pass "$name accepted (then: $last)"; else fail "$name: not refused (exit $rc): $last"; fi
  fi
}

rows=0
while IFS=$'\t' read -r name value ok change; do
  [[ -z $name || $name == \#* ]] && continue
  rows=$((rows + 1))
  case $name in
    lr)
      expect "shardopt_train --lr=$value" "$ok" "--lr" \
        tools/shardopt_train --lr="$value" --steps=1
      expect "shardctl set-lr $value" "$change" "set-lr: invalid lr" \
        tools/shardctl --coordinator=127.0.0.1:1 set-lr "$value"
      ;;
    max_grad_norm)
      expect "shardopt_train --clip=$value" "$ok" "--clip" \
        tools/shardopt_train --clip="$value" --steps=1
      ;;
  esac
done <"$table"
[[ $rows -ge 40 ]] || fail "only $rows rows in $table"
echo "$fails failed"
[[ $fails -eq 0 ]]
