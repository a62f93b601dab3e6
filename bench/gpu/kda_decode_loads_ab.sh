#!/usr/bin/env bash
# GPU machine only, from the repo root of branch kda-decode-loads-first, with main's tree in .devsrc/base
# (`git checkout kda-decode-loads-first && bench/gpu/stage_branch.sh main base`, carry .devsrc). Two batch-1 latency
# changes against main, side by side in one call of about 6 minutes: the fused-gates KDA decode step (batch rows
# <= 4) issuing all its loads in one round instead of four dependent rounds, and the final norm and the dense
# layer's post-attention norm inside their GEMM launches (two single-CTA rms_norm launches fewer a step; the step
# trace tells the two apart):
#   1. both trees built in parallel; the candidate's KDA decode cases (kernels_cuda_test KdaDecode*) and the engine's
#      CUDA cases (engine_cuda_test);
#   2. the 48B decode step at B = 1 / 2 / 4 / 8, context 4k, alternating base, candidate, base, candidate;
#   3. KdaDecodeGpu.VariantsTiming of both trees; the candidate's B = 1 step trace (the KDA decode's adds).
#   bench/gpu/kda_decode_loads_ab.sh OUTDIR
set -u
out=${1:?usage: kda_decode_loads_ab.sh OUTDIR}
mkdir -p "$out"
start=$(date +%s)
for tree in .devsrc/base .; do
  name=$([[ "$tree" == . ]] && echo candidate || echo base)
  (cd "$tree" && cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON \
    -DCMAKE_BUILD_TYPE=Release -DDELTASERVE_BENCH=OFF >"$out/build_$name.log" 2>&1 &&
    cmake --build build/gpu -j8 --target engine_gpu_bench kernels_cuda_test engine_cuda_test >>"$out/build_$name.log" 2>&1
    echo "$name build rc=$? at $(($(date +%s) - start)) s") &
done
wait
timeout 150 build/gpu/kernels/cuda/kernels_cuda_test --gtest_filter='KdaDecode*:-*Timing' >"$out/kda_tests.log" 2>&1
echo "candidate KdaDecode*: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/kda_tests.log" | tr '\n' ' ')"
timeout 300 build/gpu/engine/cuda/engine_cuda_test >"$out/engine_tests.log" 2>&1
echo "candidate engine_cuda_test: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/engine_tests.log" | tr '\n' ' ')"
config=tests/data/configs/kimi-linear-48b-a3b.config.json
for name in base candidate base candidate; do
  tree=$([[ "$name" == candidate ]] && echo . || echo .devsrc/base)
  timeout 120 "$tree/build/gpu/engine/cuda/engine_gpu_bench" --config "$config" --label "$name" --batches 1,2,4,8 \
    --contexts 4096 --prompts "" --no-ceilings --commit X --date D >>"$out/step_$name.jsonl" 2>>"$out/step_$name.err"
  echo "$name step rc=$?: $(grep -h step_time "$out/step_$name.jsonl" | grep graph | tail -4 |
    python3 -c 'import sys, json; print(" ".join("%s %.3f ms" % (json.loads(l)["case"].split(",")[1], json.loads(l)["value"]) for l in sys.stdin))')"
done
for name in base candidate; do
  tree=$([[ "$name" == candidate ]] && echo . || echo .devsrc/base)
  timeout 100 "$tree/build/gpu/kernels/cuda/kernels_cuda_test" --gtest_filter='KdaDecodeGpu.VariantsTiming' \
    >"$out/kda_timing_$name.log" 2>&1
  echo "$name KdaDecodeGpu.VariantsTiming rc=$?"
  grep -E "VariantsTiming\]" "$out/kda_timing_$name.log" | head -8 | cut -c1-150
done
bash bench/gpu/decode_trace.sh "$out/trace" 1 4096 >/dev/null 2>&1
grep -A12 "^span" "$out/trace/trace.txt" | grep -E "span|kda_decode"
echo "total $(($(date +%s) - start)) s"
