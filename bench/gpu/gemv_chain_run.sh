#!/usr/bin/env bash
# GPU machine only, from the repo root, after build/gemv_chain is built (bench/gpu/gemv_chain_bench.cu's header has
# the nvcc line): runs it once per step count and prints each variant's time and fraction of copy.
#   bench/gpu/gemv_chain_run.sh OUTDIR STEPS...      (OUTDIR/gemv_chain_STEPS.jsonl and .err)
set -u
out=${1:?usage: gemv_chain_run.sh OUTDIR STEPS...}
shift
mkdir -p "$out"
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
