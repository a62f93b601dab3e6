#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine, builds everything and runs every CPU test:
#   0. formatting check (clang-format, root .clang-format);
#   1. RelWithDebInfo build, all ctest suites except the GPU label, incl. the Python reference
#      checks (NumPy model, tiktoken) from a venv in build/pyenv and the ops checks (tests/ops:
#      dashboards, promtool rule tests, manifests, /metrics, a real Prometheus server);
#   2. the unit tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
# GPU suites (ctest label `gpu`) run on the device machine only; see README "Building for a GPU".
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${DELTASERVE_JOBS:-$(nproc)}
start=$(date +%s)

scripts/setup-debian.sh
scripts/setup-python.sh
scripts/check-format.sh

echo "== release build and tests"
cmake --preset release
cmake --build --preset release -j "$jobs"
ctest --test-dir build/release --output-on-failure -j "$jobs" -LE gpu

echo "== ASan + UBSan unit tests"
cmake --preset asan
cmake --build --preset asan -j "$jobs" --target kernels_cpu_test engine_test tokenizer_test router_test actors_test \
  actors_protocol_test kvstore_cache_test telemetry_test kvstore_index_test kvstore_transfer_test kvstore_transfer_release_test
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build/asan --output-on-failure -j "$jobs" -L unit

echo "== all tests passed in $(( $(date +%s) - start )) s"
