#!/usr/bin/env bash
# GPU machine only, from the repo root: when the MoE layer's launch 1 lets launch 2 start
# (DELTASERVE_MOE_ROUTER_TRIGGER=wait|loads|routing|exit, RouterTrigger in kernels/cuda/moe/detail/small_batch.cuh).
# Whole, it takes more than one 10-minute call (the MoeSmallBatch cases alone take ~100 s a trigger); STEP_ONLY=1
# builds engine_gpu_bench only and runs step 3 alone (about 5 minutes).
#   1. build; the MoeSmallBatch / MoeDecodeLayer cases under every trigger (the results must not change);
#   2. MoeDecodeLayerGpu.Timing (the layer alone) under every trigger;
#   3. the 48B decode step at B = 1 / 2 / 4 / 8, context 4k, every trigger, then wait and loads again (spread);
#   4. the B = 1 step's kernel timeline under wait and loads (what the router launch and launch 2 add).
#   bench/gpu/router_trigger_ab.sh OUTDIR
set -u
out=${1:?usage: router_trigger_ab.sh OUTDIR}
mkdir -p "$out"
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/gpu.txt" 2>&1
step_only=${STEP_ONLY:-0}
targets=(engine_gpu_bench)
[[ "$step_only" == 1 ]] || targets+=(kernels_cuda_test engine_cuda_test)
bash bench/gpu/build_gpu.sh "$out/build.log" "${targets[@]}"
if [[ "$step_only" == 1 ]]; then
  BATCHES=${BATCHES:-1,2,4} bash bench/gpu/decode_env_ab.sh "$out/step" "-" "DELTASERVE_MOE_ROUTER_TRIGGER=loads" \
    "DELTASERVE_MOE_ROUTER_TRIGGER=routing" "-" "DELTASERVE_MOE_ROUTER_TRIGGER=loads"
  echo "total $(($(date +%s) - start)) s"
  exit 0
fi
tests=build/gpu/kernels/cuda/kernels_cuda_test
for trigger in wait loads routing exit; do
  DELTASERVE_MOE_ROUTER_TRIGGER=$trigger timeout 120 $tests --gtest_filter='MoeSmallBatch*:MoeDecodeLayer*:-*Timing' \
    >"$out/tests_$trigger.log" 2>&1
  echo "$trigger MoeSmallBatch*/MoeDecodeLayer*: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/tests_$trigger.log" | tr '\n' ' ')"
done
DELTASERVE_MOE_ROUTER_TRIGGER=loads timeout 200 build/gpu/engine/cuda/engine_cuda_test >"$out/engine_tests_loads.log" 2>&1
echo "loads engine_cuda_test: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/engine_tests_loads.log" | tr '\n' ' ')"
for trigger in wait loads routing exit; do
  DELTASERVE_MOE_ROUTER_TRIGGER=$trigger timeout 100 $tests --gtest_filter='MoeDecodeLayerGpu.Timing' \
    >"$out/layer_$trigger.log" 2>&1
  echo "$trigger MoeDecodeLayerGpu.Timing rc=$?"
  grep -E "moe decode layer" "$out/layer_$trigger.log" | head -5 | cut -c1-110
done
BATCHES=1,2,4,8 bash bench/gpu/decode_env_ab.sh "$out/step" "-" "DELTASERVE_MOE_ROUTER_TRIGGER=loads" \
  "DELTASERVE_MOE_ROUTER_TRIGGER=routing" "DELTASERVE_MOE_ROUTER_TRIGGER=exit" "-" "DELTASERVE_MOE_ROUTER_TRIGGER=loads"
for trigger in wait loads; do
  DELTASERVE_MOE_ROUTER_TRIGGER=$trigger bash bench/gpu/decode_trace.sh "$out/trace_$trigger" 1 4096 >/dev/null 2>&1
  echo "trace $trigger: $(grep -E '^span' "$out/trace_$trigger/trace.txt" | head -1)"
  grep -A14 "^span" "$out/trace_$trigger/trace.txt" | grep -E "router|gate_up|down|skinny" | cut -c1-140
done
echo "total $(($(date +%s) - start)) s"
