#!/usr/bin/env bash
# GPU machine only, from the repo root: the CUDA engine benchmark (bench/gpu/engine_bench.cpp) on Kimi-Linear-48B
# with random weights and on two K3-shaped layers (KDA + MLA, both MoE: 896 experts leave no room for more layers on
# one GPU). Output: OUTDIR/engine_gpu.jsonl in the bench/results format (append it to bench/results/engine_gpu.jsonl).
#   bench/gpu/engine.sh OUTDIR COMMIT DATE [MACHINE (default nvidia-h200)]
set -uo pipefail
out=${1:-/tmp/engine-out}
commit=${2:-unknown}
date=${3:-unknown}
machine=${4:-nvidia-h200}
mkdir -p "$out"
cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=ON >"$out/build.log" 2>&1 &&
  cmake --build build/gpu -j16 --target engine_gpu_bench >>"$out/build.log" 2>&1 || {
  tail -30 "$out/build.log"
  exit 1
}
bin=build/gpu/bench/gpu/engine_gpu_bench
common=(--commit "$commit" --date "$date" --machine "$machine")
# Decode as a decode worker runs it (8192-token passes, the default: more memory for states and pages), prefill as
# a prefill worker would (--gpu-max-batch-tokens 16384 or 32768: the MoE GEMMs get 512 or 1024 rows per expert
# instead of 256).
echo "== Kimi-Linear-48B (random weights): decode, 8192-token passes"
timeout 330 "$bin" --config tests/data/configs/kimi-linear-48b-a3b.config.json --label kimi-linear-48b \
  --batches 1,2,4,8,32,128,256 --prompts "" "${common[@]}" \
  >"$out/engine_48b.jsonl" 2>"$out/engine_48b.err"
echo "rc=$?"; cat "$out/engine_48b.err"
for chunk in 16384 32768; do
  echo "== Kimi-Linear-48B (random weights): prefill, $chunk-token passes"
  timeout 200 "$bin" --config tests/data/configs/kimi-linear-48b-a3b.config.json --label kimi-linear-48b \
    --contexts "" --prompts 4096,32768,131072 --prefill-chunk $chunk --no-ceilings "${common[@]}" \
    >"$out/engine_48b_prefill_$chunk.jsonl" 2>"$out/engine_48b_prefill_$chunk.err"
  echo "rc=$?"; cat "$out/engine_48b_prefill_$chunk.err"
done
echo "== K3 layer shapes (2 layers: KDA+MoE, MLA+MoE)"
timeout 150 "$bin" --config tests/data/configs/kimi-k3-shape.config.json --kinds kda,mla --first-dense 0 \
  --label k3-2-layers --no-ceilings --prompts 4096,32768 --memory-fraction 0.95 "${common[@]}" \
  >"$out/engine_k3.jsonl" 2>"$out/engine_k3.err"
echo "rc=$?"; cat "$out/engine_k3.err"
for f in engine_48b engine_48b_prefill_16384 engine_48b_prefill_32768 engine_k3; do
  [[ -f "$out/$f.jsonl" ]] && cat "$out/$f.jsonl"
done >"$out/engine_gpu.jsonl"
