#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine, builds deltaserve and runs the main job: the embedded cluster
# (router, prefill and decode workers in one process) serving the built-in tiny model on the CPU at
# http://127.0.0.1:8000 (OpenAI API). Extra arguments go to `deltaserve serve` (e.g. --port 9000).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-debian.sh
cmake --preset release >/dev/null
cmake --build --preset release --target deltaserve
exec build/release/cli/deltaserve serve "$@"
