#!/usr/bin/env bash
# GPU machine only, from the repo root, after build/gpu has engine_gpu_bench (built with CUPTI): the kernel timeline
# of one graph-mode 48B decode step per batch size (engine_gpu_bench --trace-step): every kernel's start, duration and
# what it adds to the step, then the same per kernel name.
#   bench/gpu/decode_trace.sh OUTDIR [BATCHES (default 1,4)] [CONTEXTS (default 4096)]
set -uo pipefail
out=${1:?usage: decode_trace.sh OUTDIR [BATCHES] [CONTEXTS]}
mkdir -p "$out"
timeout 200 build/gpu/engine/cuda/engine_gpu_bench --config tests/data/configs/kimi-linear-48b-a3b.config.json \
  --label trace --batches "${2:-1,4}" --contexts "${3:-4096}" --prompts "" --no-ceilings --trace-step --commit X \
  --date D >"$out/trace_bench.jsonl" 2>"$out/trace.txt"
echo "rc=$?"
grep -A60 "^span" "$out/trace.txt" | head -80
