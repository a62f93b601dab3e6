#!/usr/bin/env bash
# GPU machine only, from the repo root: checks and measures the small-batch MoE defaults of 2026-12-01 (16-lane copy
# issue, whole-row down stages, unsplit down launch) in one device call of about 4 minutes:
#   1. the whole engine_cuda_test (CudaModel / CudaGraphs / CudaBackend ... against the CPU reference);
#   2. the MoE layer alone (MoeDecodeLayerGpu.Timing);
#   3. the 48B decode step at B = 1 / 2 / 4: defaults, the split down launch (DELTASERVE_MOE_DOWN_SPLIT=1), the
#      previous behaviour (DELTASERVE_MOE_LANE_ISSUE=0 DELTASERVE_MOE_DOWN_MIN_STAGES=3 DELTASERVE_MOE_DOWN_SPLIT=1),
#      defaults again;
#   4. the 48B decode record (B = 1 ... 256, contexts 4k and 32k) as engine_gpu_bench writes it;
#   5. if time is left, the step's kernel timeline at B = 1.
#   bench/gpu/moe_defaults_ab.sh /tmp/defaults COMMIT; tar -C /tmp -czf $OUT/defaults.tgz defaults
# Earlier forms ran in the sixth session of 2026-12-01: at 7641520 (device call 3: MoeSmallBatch.*, the A/B of the
# unsplit down launch, an L2 prefetch of 24 MB and the previous behaviour) and at a055f49 (call 4: a whole-row gate/up
# switch since removed in place of the previous behaviour); bench/gpu/moe_issue_ab.sh at 597835f ran call 2.
set -u
out=${1:?usage: moe_defaults_ab.sh OUTDIR COMMIT}
commit=${2:?usage: moe_defaults_ab.sh OUTDIR COMMIT}
mkdir -p "$out"
start=$(date +%s)
cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=ON >"$out/build.log" 2>&1 &&
  cmake --build build/gpu -j16 --target kernels_cuda_test engine_cuda_test engine_gpu_bench >>"$out/build.log" 2>&1
echo "build rc=$? in $(($(date +%s) - start)) s"
timeout 150 build/gpu/engine/cuda/engine_cuda_test >"$out/engine_tests.log" 2>&1
echo "engine_cuda_test rc=$? at $(($(date +%s) - start)) s"
grep -E "PASSED|FAILED|Failure" "$out/engine_tests.log" | head -8
timeout 100 build/gpu/kernels/cuda/kernels_cuda_test --gtest_filter='MoeDecodeLayerGpu.Timing' >"$out/moe_timing.log" 2>&1
echo "MoE layer rc=$?"
grep "moe decode layer" "$out/moe_timing.log" | cut -c1-120
BATCHES=1,2,4 bash bench/gpu/decode_env_ab.sh "$out/ab" "-" "DELTASERVE_MOE_DOWN_SPLIT=1" \
  "DELTASERVE_MOE_LANE_ISSUE=0 DELTASERVE_MOE_DOWN_MIN_STAGES=3 DELTASERVE_MOE_DOWN_SPLIT=1" "-"
echo "A/B done at $(($(date +%s) - start)) s"
timeout 150 build/gpu/engine/cuda/engine_gpu_bench --config tests/data/configs/kimi-linear-48b-a3b.config.json \
  --label kimi-linear-48b --batches 1,8,32,128,256 --contexts 4096,32768 --prompts "" --commit "$commit" \
  --date "$(date -u +%F)" >"$out/decode_record.jsonl" 2>"$out/decode_record.err"
echo "decode record rc=$? at $(($(date +%s) - start)) s"
grep -E "graph:" "$out/decode_record.err" | head -12
if (($(date +%s) - start < 250)); then
  bash bench/gpu/decode_trace.sh "$out/trace" 1 >/dev/null
  grep -A8 "^span" "$out/trace/trace.txt" | head -9
fi
echo "total $(($(date +%s) - start)) s"
