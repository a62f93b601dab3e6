#!/usr/bin/env bash
# GPU machine only, from the repo root: checks and measures the small-batch MoE defaults of 2026-12-01 (16-lane copy
# issue, whole-row down stages) and the L2 prefetch of the next layer's first weights while launch 1 routes:
#   1. MoeSmallBatch.* and the whole engine_cuda_test (CudaModel / CudaGraphs / CudaBackend ...) on the defaults;
#   2. the MoE layer alone (MoeDecodeLayerGpu.Timing);
#   3. the 48B decode step at B = 1 / 2 / 4: defaults, unsplit down, L2 prefetch of 24 MB, the previous behaviour
#      (DELTASERVE_MOE_LANE_ISSUE=0 DELTASERVE_MOE_DOWN_MIN_STAGES=3), defaults again;
#   4. if time is left, the step's kernel timeline at B = 1.
#   bench/gpu/moe_defaults_ab.sh /tmp/defaults; tar -C /tmp -czf $OUT/defaults.tgz defaults
set -u
out=${1:?usage: moe_defaults_ab.sh OUTDIR}
mkdir -p "$out"
start=$(date +%s)
cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=ON >"$out/build.log" 2>&1 &&
  cmake --build build/gpu -j16 --target kernels_cuda_test engine_cuda_test engine_gpu_bench >>"$out/build.log" 2>&1
echo "build rc=$? in $(($(date +%s) - start)) s"
timeout 120 build/gpu/kernels/cuda/kernels_cuda_test --gtest_filter='MoeSmallBatch.*' >"$out/moe_tests.log" 2>&1
echo "MoeSmallBatch rc=$? at $(($(date +%s) - start)) s"
grep -E "PASSED|FAILED|Failure" "$out/moe_tests.log" | head -8
timeout 200 build/gpu/engine/cuda/engine_cuda_test >"$out/engine_tests.log" 2>&1
echo "engine_cuda_test rc=$? at $(($(date +%s) - start)) s"
grep -E "PASSED|FAILED|Failure" "$out/engine_tests.log" | head -8
timeout 100 build/gpu/kernels/cuda/kernels_cuda_test --gtest_filter='MoeDecodeLayerGpu.Timing' >"$out/moe_timing.log" 2>&1
echo "MoE layer rc=$?"
grep "moe decode layer" "$out/moe_timing.log" | cut -c1-120
BATCHES=1,2,4 bash bench/gpu/decode_env_ab.sh "$out/ab" "-" "DELTASERVE_MOE_DOWN_SPLIT=0" \
  "DELTASERVE_MOE_L2_PREFETCH_MB=24" "DELTASERVE_MOE_LANE_ISSUE=0 DELTASERVE_MOE_DOWN_MIN_STAGES=3" "-"
echo "A/B done at $(($(date +%s) - start)) s"
if (($(date +%s) - start < 420)); then
  bash bench/gpu/decode_trace.sh "$out/trace" 1 >/dev/null
  grep -A14 "^span" "$out/trace/trace.txt" | head -16
fi
echo "total $(($(date +%s) - start)) s"
