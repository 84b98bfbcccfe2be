#!/usr/bin/env bash
# One coordinator, 256 simulated ranks (a CI-sized run of bench_control_plane;
# the README reports 1024): all join and get the GPT-2-small plan in < 5 s,
# heartbeats cost the coordinator < 10% of a core, the job keeps running until
# one rank goes silent, and then every other rank sees the abort -- for that
# rank -- within heartbeat timeout + 1 s.
#
# Simulated ranks heartbeat (1 Hz) from the moment they send their Join: the
# coordinator ages a rank's heartbeats from when it registers the Join, not
# from when the Join returns (after the last rank joined), so on two loaded
# cores a rank that waited for its Join to return before its first heartbeat
# was declared dead before it could send one. The bench prints the largest gap
# between a live rank's heartbeats next to the timeout, so the margin shows in
# the test log.
set -uo pipefail
tools/bench_control_plane --ranks=256 --steady=3 --heartbeat-timeout=2 \
  --fixture=tests/fixtures/gpt2_small_params.json \
  --json="${TEST_UNDECLARED_OUTPUTS_DIR:-${TMPDIR:-/tmp}}/control_plane_scale.json"
