#!/usr/bin/env bash
# (Ran at c328d40. Both switches were removed after it: the L2 prefetch in c49d7e7, the launch-2 trigger in the
# fourteenth session's review; their code is at c328d40 and 2325baf.)
# GPU machine only, from the repo root (about 6 minutes): two switches prepared in the thirteenth session, neither
# run yet, against the defaults in one binary.
#   * DELTASERVE_SKINNY_L2_PREFETCH_MB=N (SkinnyGemmParams::l2_prefetch_bytes): every skinny GEMM asks L2 for its
#     first N MiB of weights before it waits for the previous kernel, so that HBM streams them while that kernel is
#     latency-bound (o_proj behind the KDA decode step and the MLA combine; each adds ~2 us a layer past its bytes).
#     DELTASERVE_SKINNY_L2_PREFETCH_SCOPE=accumulate: o_proj (and the dense down projection) only. An earlier L2
#     prefetch of the next layer's projection during the MoE routing lost 15-53 us a step (engine_notes.md).
#   * DELTASERVE_MOE_GATE_UP_TRIGGER=issued: the MoE layer's launch 2 lets launch 3 start once each CTA's producer
#     has issued its last item (the router trigger, the same question one launch earlier, gained 1.1 % at B = 4).
# Steps: build; SkinnyGemm* cases (L2PrefetchIsOnlyAHint among them); the 48B step at B = 1 / 2 / 4 / 8, context 4k,
# under each setting; with the switches on: engine_cuda_test, and the MoE cases with `issued`; the B = 1 step's
# kernel timeline with and without the o_proj prefetch (what o_proj adds).
#   bench/gpu/next_ab15.sh OUTDIR
set -u
out=${1:?usage: next_ab15.sh OUTDIR}
mkdir -p "$out"
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/gpu.txt" 2>&1
bash bench/gpu/build_gpu.sh "$out/build.log" engine_gpu_bench kernels_cuda_test engine_cuda_test
tests=build/gpu/kernels/cuda/kernels_cuda_test
timeout 120 $tests --gtest_filter='SkinnyGemm*:-*Timing:*Bandwidth*' >"$out/skinny_tests.log" 2>&1
echo "SkinnyGemm*: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/skinny_tests.log" | tr '\n' ' ')"
p=DELTASERVE_SKINNY_L2_PREFETCH_MB
BATCHES=1,2,4,8 bash bench/gpu/decode_env_ab.sh "$out/step" "-" "$p=24" "$p=24 DELTASERVE_SKINNY_L2_PREFETCH_SCOPE=accumulate" \
  "$p=48" "$p=12 DELTASERVE_SKINNY_L2_PREFETCH_SCOPE=accumulate" "DELTASERVE_MOE_GATE_UP_TRIGGER=issued" "-" \
  "$p=24 DELTASERVE_SKINNY_L2_PREFETCH_SCOPE=accumulate"
echo "steps at $(($(date +%s) - start)) s"
DELTASERVE_SKINNY_L2_PREFETCH_MB=24 DELTASERVE_MOE_GATE_UP_TRIGGER=issued timeout 150 \
  build/gpu/engine/cuda/engine_cuda_test >"$out/engine_tests_switches.log" 2>&1
echo "engine_cuda_test, prefetch 24 MiB + issued: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/engine_tests_switches.log" | tr '\n' ' ')"
DELTASERVE_MOE_GATE_UP_TRIGGER=issued timeout 150 $tests --gtest_filter='MoeSmallBatch*:MoeDecodeLayer*:-*Timing' \
  >"$out/moe_tests_issued.log" 2>&1
echo "issued MoeSmallBatch*/MoeDecodeLayer*: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/moe_tests_issued.log" | tr '\n' ' ')"
for setting in "-" "$p=24 DELTASERVE_SKINNY_L2_PREFETCH_SCOPE=accumulate"; do
  assignments=()
  [[ "$setting" == "-" ]] || read -r -a assignments <<<"$setting"
  name=$([[ "$setting" == "-" ]] && echo default || echo prefetch)
  env "${assignments[@]}" bash bench/gpu/decode_trace.sh "$out/trace_$name" 1 4096 >/dev/null 2>&1
  echo "B = 1 step trace, $setting: $(grep -E '^span' "$out/trace_$name/trace.txt" | head -1)"
  grep -A14 "^span" "$out/trace_$name/trace.txt" | grep -E "skinny|kda_decode|router" | cut -c1-140
done
echo "total $(($(date +%s) - start)) s"
