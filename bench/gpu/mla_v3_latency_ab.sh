#!/usr/bin/env bash
# GPU machine only, from the repo root of branch mla-v3-latency: builds the engine-only tree, runs the MLA decode
# tests with the branch's two latency changes on (the default) and off, then MlaDecodeGpu.Timing, the 48B decode step
# and the B = 1 step's kernel timeline under each switch (about 4 minutes).
#   bench/gpu/mla_v3_latency_ab.sh OUTDIR
# Switches (mla_decode_wgmma.cu): DELTASERVE_MLA_V3_PAGES_AHEAD=0 (the producer reads a tile's page ids only after
# its stage is free), DELTASERVE_MLA_V3_Q_BY_BOTH=0 (warpgroup 0 alone loads q̃).
set -uo pipefail
out=${1:?usage: mla_v3_latency_ab.sh OUTDIR}
mkdir -p "$out"
off="DELTASERVE_MLA_V3_PAGES_AHEAD=0 DELTASERVE_MLA_V3_Q_BY_BOTH=0"
cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=OFF >"$out/build.log" 2>&1
cmake --build build/gpu -j16 >>"$out/build.log" 2>&1 || { grep -E " error" "$out/build.log" | head; exit 1; }
test=build/gpu/kernels/cuda/kernels_cuda_test
filter='MlaDecode.*:MlaAttentionValidation.*:MlaWriteRows*'
for setting in "-" "$off"; do
  assignments=()
  [[ "$setting" == "-" ]] || read -r -a assignments <<<"$setting"
  env "${assignments[@]}" timeout 200 "$test" --gtest_filter="$filter" >"$out/tests_${#assignments[@]}.log" 2>&1
  echo "[$setting] MLA tests rc=$?: $(grep -E '^\[  (PASSED|FAILED)' "$out/tests_${#assignments[@]}.log" | tr '\n' ' ')"
done
for setting in "-" "DELTASERVE_MLA_V3_PAGES_AHEAD=0" "DELTASERVE_MLA_V3_Q_BY_BOTH=0" "$off"; do
  assignments=()
  [[ "$setting" == "-" ]] || read -r -a assignments <<<"$setting"
  echo "== MlaDecodeGpu.Timing [$setting]"
  env "${assignments[@]}" timeout 60 "$test" --gtest_filter=MlaDecodeGpu.Timing 2>&1 | grep -E "Timing\]" |
    sed -E 's/write_rows \+ mla_decode //; s/legacy [0-9.]+ us, //' | cut -c1-200
done
BATCHES=1,2,8 CONTEXTS=4096,32768 bash bench/gpu/decode_env_ab.sh "$out/ab" "-" "DELTASERVE_MLA_V3_PAGES_AHEAD=0" \
  "DELTASERVE_MLA_V3_Q_BY_BOTH=0" "$off" "-"
for setting in "-" "$off"; do
  assignments=()
  [[ "$setting" == "-" ]] || read -r -a assignments <<<"$setting"
  env "${assignments[@]}" bash bench/gpu/decode_trace.sh "$out/trace_${#assignments[@]}" 1 4096,32768 >/dev/null 2>&1
  echo "== trace [$setting]"
  grep -A10 "^span" "$out/trace_${#assignments[@]}/trace.txt" | grep -E "span|mla"
done
bash bench/gpu/mla_v3_trace.sh "$out/v3trace"
