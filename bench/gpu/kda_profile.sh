#!/usr/bin/env bash
# GPU machine only: build, GPU tests, Nsight Compute on the prefill/decode kernels (sections, then the prefill
# kernels' instruction-level stall samples), and our timings (no peer).
#   bench/gpu/kda_profile.sh OUTDIR
set -uo pipefail
out=${1:-/tmp/kda-out}
mkdir -p "$out"
cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=OFF >"$out/build.log" 2>&1
cmake --build build/gpu -j16 --target kernels_cuda_test >>"$out/build.log" 2>&1 || tail -40 "$out/build.log"
nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -I. -Xcudafe=--diag_suppress=2810 \
  bench/gpu/kda_gpu_bench.cu kernels/cuda/kda/chunk_prefill.cu kernels/cuda/kda/decode.cu \
  -o build/gpu/kda_gpu_bench >>"$out/build.log" 2>&1 || tail -20 "$out/build.log"
timeout 120 ctest --test-dir build/gpu -L gpu --output-on-failure -V >"$out/tests.log" 2>&1
echo "ctest rc=$?"
grep -E "tests passed|FAILED" "$out/tests.log" | sed 's/^[0-9]*: //' | sort -u | head
sec="--section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis"
timeout 150 ncu --clock-control none -k regex:kda_chunk -c 2 $sec build/gpu/kda_gpu_bench prefill16k >"$out/ncu_prefill.txt" 2>&1
timeout 60 ncu --clock-control none -k regex:kda_decode -c 1 $sec build/gpu/kda_gpu_bench decode64 >"$out/ncu_decode.txt" 2>&1
grep -E "kda_|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued|L2 Hit|Theoretical Occ" "$out/ncu_prefill.txt" "$out/ncu_decode.txt" | cut -c1-150 | head -60
# Instruction-level stall samples of each prefill kernel (H=32, T=16k): bench/gpu/sass_hotspots.py.
for kernel in kda_chunk_prep kda_chunk_state; do
  timeout 150 ncu --clock-control none --section WarpStateStats --section SourceCounters -k "regex:$kernel" -c 1 \
    --page source --print-source sass --csv build/gpu/kda_gpu_bench h=32 >"$out/sass_$kernel.csv" 2>"$out/sass_$kernel.err"
  echo "== $kernel"
  python3 bench/gpu/sass_hotspots.py "$out/sass_$kernel.csv" 30 | cut -c1-170
done
timeout 150 build/gpu/kda_gpu_bench >"$out/ours.jsonl" 2>"$out/ours.err"
cut -c1-110 "$out/ours.jsonl"; cat "$out/ours.err"
