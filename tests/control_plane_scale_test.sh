#!/usr/bin/env bash
# One coordinator, 256 simulated ranks (a CI-sized run of bench_control_plane;
# the README reports 1024): all join and get the GPT-2-small plan in < 5 s,
# heartbeats cost the coordinator < 10% of a core, and when one rank goes
# silent every other one sees the abort within heartbeat timeout + 1 s.
set -uo pipefail
tools/bench_control_plane --ranks=256 --steady=3 --heartbeat-timeout=2 \
  --fixture=tests/fixtures/gpt2_small_params.json
