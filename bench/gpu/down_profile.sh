#!/usr/bin/env bash
# GPU machine only, from the repo root: where launch 3 of the small-batch MoE layer (pipeline_down_kernel, 144 CTAs
# of 16 output columns at hidden 2304) spends its time at T = 1: it streams its 42 MB at ~0.6 of the copy bandwidth
# in the 48B step (~15.5 us a layer against ~10 of bytes), and neither splitting the tiles over two CTAs nor an even
# share of the (tile, expert) list per CTA (branch moe-down-balance) made it faster. Prints the kernel's sections
# (memory throughput, occupancy, warp states), then the instructions with the most stall samples
# (bench/gpu/sass_hotspots.py). About 2 minutes.
#   bench/gpu/down_profile.sh OUTDIR
set -uo pipefail
out=${1:?usage: down_profile.sh OUTDIR}
mkdir -p "$out"
cmake -S . -B build/gpu-lineinfo -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=OFF -DCMAKE_CUDA_FLAGS=-lineinfo >"$out/build.log" 2>&1 &&
  cmake --build build/gpu-lineinfo -j16 --target kernels_cuda_test >>"$out/build.log" 2>&1 || tail -20 "$out/build.log"
test_bin=build/gpu-lineinfo/kernels/cuda/kernels_cuda_test
# The first down launch of LayerKimi48B runs at T = 1 with the Kimi-Linear-48B shapes (E = 256, k = 8).
filter=--gtest_filter=MoeSmallBatch.LayerKimi48B
sec="--section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy --section WarpStateStats"
timeout 120 ncu --clock-control none -k regex:pipeline_down_kernel -c 1 $sec "$test_bin" "$filter" \
  >"$out/ncu_down.txt" 2>&1
echo "ncu sections rc=$?"
grep -E "pipeline_down|Duration|Memory Throughput|DRAM Throughput|Grid Size|Registers Per|Achieved Occupancy|Stall|Warp Cycles Per Issued|Issue Slot" \
  "$out/ncu_down.txt" | cut -c1-150 | head -30
timeout 150 ncu --clock-control none --section WarpStateStats --section SourceCounters -k regex:pipeline_down_kernel \
  -c 1 --page source --print-source sass --csv "$test_bin" "$filter" >"$out/sass_down.csv" 2>"$out/sass_down.err"
echo "ncu source rc=$?"
python3 bench/gpu/sass_hotspots.py "$out/sass_down.csv" 40 | cut -c1-170
