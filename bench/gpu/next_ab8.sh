#!/usr/bin/env bash
# GPU machine only, from the repo root of main: the two measurements prepared at the end of the eighth session, in
# one call of about 4 minutes (bench/gpu/engine_notes.md, eighth session):
#   1. bench/gpu/gemv_chain_bench.cu: 52 dependent batch-1 GEMVs as skinny_gemm launches (PDL, graph) against one
#      persistent kernel whose producer streams on across the grid-wide dependency, and the same kernel without
#      that run-ahead; each against the copy bandwidth of the same run, checked against a CPU reference first;
#   2. bench/gpu/moe_down_trace.py: per-fill issue and arrival times of the MoE down launch's stages, per CTA,
#      inside the layer replayed in a graph (T = 1, 2, 4; MoeDecodeLayerGpu.Timing of the patched tree).
#   bench/gpu/next_ab8.sh OUTDIR
set -u
out=${1:?usage: next_ab8.sh OUTDIR}
mkdir -p "$out" build
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/gpu.txt" 2>&1
(nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcudafe=--diag_suppress=2810 -I. \
  bench/gpu/gemv_chain_bench.cu kernels/cuda/gemm/small_batch_gemm.cu -o build/gemv_chain >"$out/gemv_build.log" 2>&1
  echo "gemv_chain build rc=$? at $(($(date +%s) - start)) s") &
(python3 bench/gpu/moe_down_trace.py . /tmp/down-trace >"$out/trace_build.log" 2>&1 &&
  cmake -S /tmp/down-trace -B /tmp/down-trace/build -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON \
    -DCMAKE_BUILD_TYPE=Release -DDELTASERVE_BENCH=OFF >>"$out/trace_build.log" 2>&1 &&
  cmake --build /tmp/down-trace/build -j12 --target kernels_cuda_test >>"$out/trace_build.log" 2>&1
  echo "down trace build rc=$? at $(($(date +%s) - start)) s") &
wait
timeout 120 build/gemv_chain --steps 52 >"$out/gemv_chain.jsonl" 2>"$out/gemv_chain.err"
echo "gemv_chain rc=$?"
cat "$out/gemv_chain.err" "$out/gemv_chain.jsonl"
timeout 150 /tmp/down-trace/build/kernels/cuda/kernels_cuda_test --gtest_filter=MoeDecodeLayerGpu.Timing \
  >"$out/down_trace.log" 2>&1
echo "down trace rc=$?"
grep "down trace T= 1 rep 3" "$out/down_trace.log" | cut -c1-160
grep "moe decode layer" "$out/down_trace.log" | head -3 | cut -c1-100
echo "total $(($(date +%s) - start)) s"
