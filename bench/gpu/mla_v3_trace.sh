#!/usr/bin/env bash
# GPU machine only, from the repo root of branch mla-v3-latency: builds bench/gpu/mla_v3_trace_bench.cu with the v3
# attention's timeline stamps (-DDELTASERVE_MLA_V3_TRACE) and prints where its CTAs wait, with the branch's latency
# changes on and off (about 1 minute).
#   bench/gpu/mla_v3_trace.sh OUTDIR
set -uo pipefail
out=${1:?usage: mla_v3_trace.sh OUTDIR}
mkdir -p "$out"
nvcc -std=c++20 -O3 -DDELTASERVE_MLA_V3_TRACE -gencode=arch=compute_90a,code=sm_90a -Xcudafe=--diag_suppress=2810 -I. \
  bench/gpu/mla_v3_trace_bench.cu kernels/cuda/mla_decode.cu kernels/cuda/mla_decode_wgmma.cu \
  kernels/cuda/mla_decode_reference.cu -o "$out/mla_v3_trace_bench" >"$out/build.log" 2>&1 ||
  { grep -E "error" "$out/build.log" | head; exit 1; }
for setting in "-" "DELTASERVE_MLA_V3_PAGES_AHEAD=0 DELTASERVE_MLA_V3_Q_BY_BOTH=0"; do
  assignments=()
  [[ "$setting" == "-" ]] || read -r -a assignments <<<"$setting"
  echo "== [$setting]"
  env "${assignments[@]}" timeout 120 "$out/mla_v3_trace_bench" | tee "$out/trace_${#assignments[@]}.txt"
done
