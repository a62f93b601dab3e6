#!/usr/bin/env bash
# Shared-prefix workloads (Mooncake trace sessions; long system prompts + multi-turn chats) replayed
# through `deltaserve serve` with cache-aware routing, load-only routing and the cache off, in one run.
# Appends JSON lines to bench/results/prefix_replay.jsonl. Extra flags go to bench/prefix_replay.py.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset release >/dev/null
cmake --build --preset release --target deltaserve >/dev/null
mkdir -p bench/results
python3 bench/prefix_replay.py --command "bench/prefix_replay.sh $*" "$@" | tee -a bench/results/prefix_replay.jsonl
