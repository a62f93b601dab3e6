#!/usr/bin/env bash
# GPU machine only, from the repo root of branch mla-v3-latency: builds bench/gpu/mla_v3_trace_bench.cu with the v3
# attention's timeline stamps (-DDELTASERVE_MLA_V3_TRACE) and prints where its CTAs wait, with the branch's latency
# changes on and off (about 1 minute).
#   bench/gpu/mla_v3_trace.sh OUTDIR [SETTING...]
# SETTING: "-" (the defaults) or environment assignments; by default "-" and the v3 latency switches off. The output
# of the i-th setting goes to OUTDIR/trace_i.txt.
set -uo pipefail
out=${1:?usage: mla_v3_trace.sh OUTDIR}
mkdir -p "$out"
nvcc -std=c++20 -O3 -DDELTASERVE_MLA_V3_TRACE -gencode=arch=compute_90a,code=sm_90a -Xcudafe=--diag_suppress=2810 -I. \
  bench/gpu/mla_v3_trace_bench.cu kernels/cuda/mla/decode.cu kernels/cuda/mla/decode_wgmma.cu \
  kernels/cuda/mla/decode_reference.cu -o "$out/mla_v3_trace_bench" >"$out/build.log" 2>&1 ||
  { grep -E "error" "$out/build.log" | head; exit 1; }
out_dir=$out
shift
settings=("$@")
[[ ${#settings[@]} -gt 0 ]] || settings=("-" "DELTASERVE_MLA_V3_PAGES_AHEAD=0 DELTASERVE_MLA_V3_Q_BY_BOTH=0")
i=0
for setting in "${settings[@]}"; do
  i=$((i + 1))
  assignments=()
  [[ "$setting" == "-" ]] || read -r -a assignments <<<"$setting"
  echo "== [$setting]"
  env "${assignments[@]}" timeout 120 "$out_dir/mla_v3_trace_bench" | tee "$out_dir/trace_$i.txt"
done
