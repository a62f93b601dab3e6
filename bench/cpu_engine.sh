#!/usr/bin/env bash
# CPU engine prefill/decode tokens/s on the tiny presets; appends JSON lines to
# bench/results/cpu_engine.jsonl (one line per case, with date, commit, machine, command).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset release >/dev/null
cmake --build --preset release --target cpu_engine_bench >/dev/null
machine=${DELTASERVE_MACHINE:-"cpu-$(nproc)core-$(uname -m)"}
raw=$(mktemp)
build/release/bench/cpu_engine_bench --benchmark_format=json --benchmark_repetitions=3 \
  --benchmark_report_aggregates_only=true >"$raw"
python3 bench/report_cpu_engine.py "$raw" "$machine" "$(git rev-parse --short HEAD)" "bench/cpu_engine.sh" \
  | tee -a bench/results/cpu_engine.jsonl
rm -f "$raw"
