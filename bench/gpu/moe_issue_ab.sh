#!/usr/bin/env bash
# GPU machine only, from the repo root: one device call of about 5 minutes that measures the small-batch MoE copy
# issue experiments of 2026-12-01 (the sixth session) against main's behaviour:
#   * bench/gpu/dram_pattern_bench.cu: bare bulk-copy streaming patterns against the copy bandwidth (one issuing lane
#     against 16; down stages as launched; whole 2 KB down rows in two stages);
#   * MoeSmallBatch.* (bitwise tests) under DELTASERVE_MOE_LANE_ISSUE=1 and DELTASERVE_MOE_DOWN_MIN_STAGES=2;
#   * the MoE layer alone (MoeDecodeLayerGpu.Timing) and the 48B decode step at B = 1 / 2 / 4 under each setting;
#   * the step's kernel timeline at B = 1 (main's behaviour).
#   bench/gpu/moe_issue_ab.sh /tmp/issue; tar -C /tmp -czf $OUT/issue.tgz issue
set -u
out=${1:?usage: moe_issue_ab.sh OUTDIR}
mkdir -p "$out"
start=$(date +%s)
nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. -Xcudafe=--diag_suppress=2810 \
  bench/gpu/dram_pattern_bench.cu -o /tmp/dram_pattern_bench >"$out/dram_build.log" 2>&1 &
dram_pid=$!
cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=ON >"$out/build.log" 2>&1 &&
  cmake --build build/gpu -j16 --target kernels_cuda_test engine_cuda_test engine_gpu_bench >>"$out/build.log" 2>&1
echo "build rc=$? in $(($(date +%s) - start)) s"
wait $dram_pid
timeout 120 /tmp/dram_pattern_bench >"$out/dram_pattern.jsonl" 2>&1
echo "dram patterns rc=$?"
cut -c1-160 "$out/dram_pattern.jsonl"
settings=("-" "DELTASERVE_MOE_LANE_ISSUE=1" "DELTASERVE_MOE_DOWN_MIN_STAGES=2"
  "DELTASERVE_MOE_LANE_ISSUE=1 DELTASERVE_MOE_DOWN_MIN_STAGES=2")
i=0
for setting in "${settings[@]}"; do
  i=$((i + 1))
  assignments=()
  [[ "$setting" == "-" ]] || read -r -a assignments <<<"$setting"
  if [[ "$setting" != "-" ]]; then
    env "${assignments[@]}" timeout 120 build/gpu/kernels/cuda/kernels_cuda_test --gtest_filter='MoeSmallBatch.*' \
      >"$out/tests$i.log" 2>&1
    echo "[$setting] MoeSmallBatch rc=$? $(grep -cE '^\[       OK' "$out/tests$i.log") ok"
    grep -E "FAILED|Failure" "$out/tests$i.log" | head -5
  fi
  env "${assignments[@]}" timeout 100 build/gpu/kernels/cuda/kernels_cuda_test \
    --gtest_filter='MoeDecodeLayerGpu.Timing' >"$out/moe_timing$i.log" 2>&1
  echo "[$setting] MoE layer rc=$?"
  grep "moe decode layer" "$out/moe_timing$i.log" | head -3 | cut -c1-110
done
BATCHES=1,2,4 bash bench/gpu/decode_env_ab.sh "$out/ab" "${settings[@]}" "-"
bash bench/gpu/decode_trace.sh "$out/trace" 1 >/dev/null
grep -A14 "^span" "$out/trace/trace.txt" | head -16
echo "total $(($(date +%s) - start)) s"
