#!/usr/bin/env bash
# GPU machine only, from the repo root (about 2 minutes, nvcc alone): bench/gpu/gemv_chain_bench.cu with the LL
# kernel's two added timings: polls 256 ns apart (does the L2 traffic of 1056 polling warps explain its 0.36 of
# copy?) and x constant from L1 (the persistent streaming core alone: does it reach ~0.9 of copy?). Ran at a077b4d
# (0.37 and 0.90-0.92). Since then the binary also times chain_ll_cta_kernel (x gathered once per CTA): with its
# dependency, does a persistent chain now get near the ~0.9 of its streaming core?
#   bench/gpu/next_ab14.sh OUTDIR
set -u
out=${1:?usage: next_ab14.sh OUTDIR}
mkdir -p "$out" build
nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/gpu.txt" 2>&1
bash bench/gpu/gemv_chain_run.sh "$out" 52 128
