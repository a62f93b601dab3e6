#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine, builds deltaserve and runs the main job on the built-in tiny
# model on the CPU. Extra arguments go to `deltaserve generate` (e.g. --prompt "..." --max-tokens 32).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-debian.sh
cmake --preset release >/dev/null
cmake --build --preset release --target deltaserve
if (($# == 0)); then
  set -- --chat --prompt "Tell me about linear attention." --max-tokens 48
fi
exec build/release/cli/deltaserve generate "$@"
