#!/usr/bin/env bash
# GPU machine only, from the repo root: builds build/gemv_chain (bench/gpu/gemv_chain_bench.cu, nvcc alone) unless
# it is newer than its sources, runs it once per step count and prints each variant's time and fraction of copy.
#   bench/gpu/gemv_chain_run.sh OUTDIR STEPS...      (OUTDIR/gemv_chain_STEPS.jsonl and .err, OUTDIR/gemv_build.log)
set -u
out=${1:?usage: gemv_chain_run.sh OUTDIR STEPS...}
shift
mkdir -p "$out" build
sources=(bench/gpu/gemv_chain_bench.cu kernels/cuda/gemm/small_batch_gemm.cu)
stale=0
for source in "${sources[@]}"; do [[ build/gemv_chain -nt "$source" ]] || stale=1; done
if [[ $stale == 1 ]]; then
  nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcudafe=--diag_suppress=2810 -I. "${sources[@]}" \
    -o build/gemv_chain >"$out/gemv_build.log" 2>&1
  echo "gemv_chain build rc=$?"
fi
for steps in "$@"; do
  timeout 150 build/gemv_chain --steps "$steps" >"$out/gemv_chain_$steps.jsonl" 2>"$out/gemv_chain_$steps.err"
  echo "gemv_chain --steps $steps rc=$?"
  cat "$out/gemv_chain_$steps.err"
  python3 - "$out/gemv_chain_$steps.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"  {r['case'].split(',', 2)[-1]}: {r['value']:.1f} us, {r['per_step_us']:.2f} us a step, "
          f"{r['ratio_to_limit']:.3f} of copy")
PY
done
