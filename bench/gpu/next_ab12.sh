#!/usr/bin/env bash
# GPU machine only, from the repo root of main: the two measurements prepared at the end of the eleventh session
# (bench/gpu/engine_notes.md), in one call of about 2 minutes; both build with nvcc alone (no cmake):
#   1. the v3 MLA decode attention's finer timeline (bench/gpu/mla_v3_trace.sh): where the stage refill gap and
#      warpgroup 0's ~1 us a tile go;
#   2. bench/gpu/gemv_chain_bench.cu with chain_ring_kernel: does a persistent GEMV chain that streams like the
#      skinny GEMM reach ~0.85-0.9 of copy across its grid-wide dependencies?
#   bench/gpu/next_ab12.sh OUTDIR
set -u
out=${1:?usage: next_ab12.sh OUTDIR}
mkdir -p "$out" build
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/gpu.txt" 2>&1
bash bench/gpu/mla_v3_trace.sh "$out/v3trace" - >"$out/v3trace.log" 2>&1
echo "v3 trace rc=$? at $(($(date +%s) - start)) s"
grep -vE "^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ \|" "$out/v3trace.log" | head -60
bash bench/gpu/gemv_chain_run.sh "$out" 52
echo "total $(($(date +%s) - start)) s"
