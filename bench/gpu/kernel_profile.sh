#!/usr/bin/env bash
# GPU machine only, from the repo root: Nsight Compute of one kernel launch in a kernels_cuda_test case, built with
# -lineinfo in build/gpu-lineinfo: the kernel's sections (speed of light, memory, launch, occupancy, warp states),
# then the instructions with the most warp-stall samples (bench/gpu/sass_hotspots.py). The first launch whose name
# matches KERNEL_REGEX is profiled. Used by router_profile.sh and down_profile.sh; about 2 minutes.
#   bench/gpu/kernel_profile.sh OUTDIR KERNEL_REGEX GTEST_FILTER NAME
set -uo pipefail
out=${1:?usage: kernel_profile.sh OUTDIR KERNEL_REGEX GTEST_FILTER NAME}
kernel=${2:?kernel regex}
filter=--gtest_filter=${3:?gtest filter}
name=${4:?name of the output files}
mkdir -p "$out"
cmake -S . -B build/gpu-lineinfo -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=OFF -DCMAKE_CUDA_FLAGS=-lineinfo >"$out/build.log" 2>&1 &&
  cmake --build build/gpu-lineinfo -j16 --target kernels_cuda_test >>"$out/build.log" 2>&1 || tail -20 "$out/build.log"
test_bin=build/gpu-lineinfo/kernels/cuda/kernels_cuda_test
sec="--section SpeedOfLight --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy"
sec="$sec --section WarpStateStats"
timeout 120 ncu --clock-control none -k "regex:$kernel" -c 1 $sec "$test_bin" "$filter" >"$out/ncu_$name.txt" 2>&1
echo "ncu sections rc=$?"
grep -E "$kernel|Duration|Memory Throughput|DRAM Throughput|Grid Size|Registers Per|Achieved Occupancy|Stall|Warp Cycles Per Issued|Issue Slot" \
  "$out/ncu_$name.txt" | cut -c1-150 | head -30
timeout 150 ncu --clock-control none --section WarpStateStats --section SourceCounters -k "regex:$kernel" -c 1 \
  --page source --print-source sass --csv "$test_bin" "$filter" >"$out/sass_$name.csv" 2>"$out/sass_$name.err"
echo "ncu source rc=$?"
python3 bench/gpu/sass_hotspots.py "$out/sass_$name.csv" 40 | cut -c1-170
