#!/usr/bin/env bash
# GPU machine only, from the repo root: builds kernels/ + engine/ with CUDA (engine-only, sm_90a; the GPU benchmarks
# too, so that they keep compiling) and runs every test with the ctest label gpu (kernels_cuda_test,
# engine_cuda_test). Logs go to OUTDIR.
#   bench/gpu/gpu_tests.sh OUTDIR [ctest -R regex]
set -uo pipefail
out=${1:-/tmp/gpu-tests}
filter=${2:-}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$out/gpu.txt" 2>&1
echo "== configure + build"
start=$(date +%s)
cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=ON >"$out/build.log" 2>&1 &&
  cmake --build build/gpu -j16 >>"$out/build.log" 2>&1
build_rc=$?
echo "build rc=$build_rc in $(($(date +%s) - start)) s"
if [[ $build_rc -ne 0 ]]; then grep -E "error|Error" "$out/build.log" | head -40; fi
echo "== tests (label gpu)"
args=(--test-dir build/gpu -L gpu --output-on-failure --timeout 300 -j4)
[[ -n "$filter" ]] && args+=(-R "$filter")
timeout 420 ctest "${args[@]}" >"$out/tests.log" 2>&1
echo "ctest rc=$?"
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|\(SEGFAULT\)|Exception" "$out/tests.log" | head -80
