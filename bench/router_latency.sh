#!/usr/bin/env bash
# Router-added latency (client TTFT minus the engine's own time, p50/p99) and requests/s through the
# HTTP front, single-process `serve` and router + prefill + 2 decode processes, with the tiny model on
# the CPU. Appends JSON lines to bench/results/router_latency.jsonl (date, commit, machine, command).
# Extra flags go to bench/router_latency.py (--requests, --duration, --concurrency, --topologies).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset release >/dev/null
cmake --build --preset release --target deltaserve >/dev/null
mkdir -p bench/results
python3 bench/router_latency.py --command "bench/router_latency.sh $*" "$@" \
  | tee -a bench/results/router_latency.jsonl
