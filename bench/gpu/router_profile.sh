#!/usr/bin/env bash
# GPU machine only, from the repo root: where launch 1 of the small-batch MoE layer (small_batch_router_kernel)
# spends its ~10 us at T = 1. Its last CTA routes and builds the plan alone for most of that time (phases of a few
# hundred instructions that take ~1 us each, bench/gpu/engine_notes.md), so Nsight Compute's warp-state samples of
# the kernel are mostly that CTA's stalls. Prints the kernel's sections, then the instructions with the most stall
# samples (bench/gpu/sass_hotspots.py). About 2 minutes.
#   bench/gpu/router_profile.sh OUTDIR
set -uo pipefail
out=${1:?usage: router_profile.sh OUTDIR}
mkdir -p "$out"
cmake -S . -B build/gpu-lineinfo -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=OFF -DCMAKE_CUDA_FLAGS=-lineinfo >"$out/build.log" 2>&1 &&
  cmake --build build/gpu-lineinfo -j16 --target kernels_cuda_test >>"$out/build.log" 2>&1 || tail -20 "$out/build.log"
test_bin=build/gpu-lineinfo/kernels/cuda/kernels_cuda_test
# The first router launch of LayerKimi48B runs at T = 1 with the Kimi-Linear-48B shapes (E = 256, k = 8).
filter=--gtest_filter=MoeSmallBatch.LayerKimi48B
sec="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats"
timeout 120 ncu --clock-control none -k regex:small_batch_router -c 1 $sec "$test_bin" "$filter" \
  >"$out/ncu_router.txt" 2>&1
echo "ncu sections rc=$?"
grep -E "small_batch_router|Duration|Grid Size|Registers Per|Achieved Occupancy|Stall|Warp Cycles Per Issued|Issue Slot" \
  "$out/ncu_router.txt" | cut -c1-150 | head -30
timeout 150 ncu --clock-control none --section WarpStateStats --section SourceCounters -k regex:small_batch_router \
  -c 1 --page source --print-source sass --csv "$test_bin" "$filter" >"$out/sass_router.csv" 2>"$out/sass_router.err"
echo "ncu source rc=$?"
python3 bench/gpu/sass_hotspots.py "$out/sass_router.csv" 40 | cut -c1-170
