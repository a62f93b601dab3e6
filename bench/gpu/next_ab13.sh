#!/usr/bin/env bash
# GPU machine only, from the repo root of main: the twelfth session's last call (about 5 minutes):
#   1. bench/gpu/gemv_chain_bench.cu with chain_ll_kernel (the step dependency carried in the data: every output
#      word holds its value and a step tag, so a warp polls its x words directly instead of a fence, a grid-wide
#      counter and CTA barriers): does a persistent GEMV chain then reach ~0.85-0.9 of copy?
#   2. the 48B decode step with the MoE layer's launch 2 starting early (default) and only after launch 1 has ended
#      (DELTASERVE_MOE_GATE_UP_PDL=0): does the routing, ~2x slower beside launch 2's early streams, gain more than
#      the shared expert's gate/up stream loses?
#   3. the MoE cases and MoeDecodeLayerGpu.Timing under both settings.
#   bench/gpu/next_ab13.sh OUTDIR
# (Ran at f50016c; the DELTASERVE_MOE_GATE_UP_PDL switch was removed after it measured slower, so item 2 now runs the
# default four times.)
set -u
out=${1:?usage: next_ab13.sh OUTDIR}
mkdir -p "$out" build
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/gpu.txt" 2>&1
cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=OFF >"$out/build.log" 2>&1 &&
  cmake --build build/gpu -j16 --target engine_gpu_bench kernels_cuda_test >>"$out/build.log" 2>&1
echo "cmake build rc=$? at $(($(date +%s) - start)) s"
bash bench/gpu/gemv_chain_run.sh "$out" 52 128
BATCHES=1,2,4 bash bench/gpu/decode_env_ab.sh "$out/ab" "-" "DELTASERVE_MOE_GATE_UP_PDL=0" "-" \
  "DELTASERVE_MOE_GATE_UP_PDL=0"
for setting in 1 0; do
  DELTASERVE_MOE_GATE_UP_PDL=$setting timeout 200 build/gpu/kernels/cuda/kernels_cuda_test \
    --gtest_filter='MoeSmallBatch*:MoeDecodeLayerGpu.*' >"$out/moe_tests_$setting.log" 2>&1
  echo "MoeSmallBatch* + MoeDecodeLayerGpu.* with DELTASERVE_MOE_GATE_UP_PDL=$setting: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/moe_tests_$setting.log" | tr '\n' ' ')"
  grep -E "moe decode layer" "$out/moe_tests_$setting.log" | head -6 | cut -c1-150
done
echo "total $(($(date +%s) - start)) s"
