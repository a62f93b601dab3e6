#!/usr/bin/env bash
# GPU machine only, from the repo root (about 5 minutes after bench/gpu/gpu_tests.sh, whose build it reuses): the
# MoE layer's launch 2 letting launch 3 start once each CTA's producer has issued its last item
# (DELTASERVE_MOE_GATE_UP_TRIGGER=issued) against right after its wait (the default). The same kind of change as
# the router trigger (launch 1 -> 2), which gained 1.1 % at B = 4 and nothing at B = 1 (thirteenth session).
#   1. the 48B decode step at B = 1 / 2 / 4 / 8, context 4k, default / issued, twice;
#   2. with issued: the MoeSmallBatch / MoeDecodeLayer cases and engine_cuda_test (the results must not change);
#      MoeDecodeLayerGpu.Timing under both.
#   bench/gpu/next_ab15.sh OUTDIR
set -u
out=${1:?usage: next_ab15.sh OUTDIR}
mkdir -p "$out"
start=$(date +%s)
cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=OFF >"$out/build.log" 2>&1 &&
  cmake --build build/gpu -j16 --target engine_gpu_bench kernels_cuda_test engine_cuda_test >>"$out/build.log" 2>&1
echo "build rc=$? at $(($(date +%s) - start)) s"
BATCHES=1,2,4,8 bash bench/gpu/decode_env_ab.sh "$out/step" "-" "DELTASERVE_MOE_GATE_UP_TRIGGER=issued" "-" \
  "DELTASERVE_MOE_GATE_UP_TRIGGER=issued"
tests=build/gpu/kernels/cuda/kernels_cuda_test
DELTASERVE_MOE_GATE_UP_TRIGGER=issued timeout 150 $tests --gtest_filter='MoeSmallBatch*:MoeDecodeLayer*:-*Timing' \
  >"$out/moe_tests_issued.log" 2>&1
echo "issued MoeSmallBatch*/MoeDecodeLayer*: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/moe_tests_issued.log" | tr '\n' ' ')"
DELTASERVE_MOE_GATE_UP_TRIGGER=issued timeout 150 build/gpu/engine/cuda/engine_cuda_test >"$out/engine_tests_issued.log" 2>&1
echo "issued engine_cuda_test: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/engine_tests_issued.log" | tr '\n' ' ')"
for trigger in wait issued; do
  DELTASERVE_MOE_GATE_UP_TRIGGER=$trigger timeout 100 $tests --gtest_filter='MoeDecodeLayerGpu.Timing' \
    >"$out/layer_$trigger.log" 2>&1
  echo "launch 2 trigger $trigger, MoeDecodeLayerGpu.Timing rc=$?"
  grep -E "moe decode layer" "$out/layer_$trigger.log" | head -5 | cut -c1-110
done
echo "total $(($(date +%s) - start)) s"
