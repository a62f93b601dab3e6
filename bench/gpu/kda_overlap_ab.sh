#!/usr/bin/env bash
# GPU machine only, from the repo root (about 3-4 minutes): the overlapped KDA state pass
# (DELTASERVE_KDA_STATE_PASS=overlap: a CTA per head launched first, the prep beside it as its programmatic
# dependent, each chunk's factors read once the prep flags them) against the default, H = 32 at T = 4k / 16k / 64k,
# alternating twice; before that, the chunked-prefill and context-parallel GPU cases (every case now runs the
# overlapped pass too). Every process runs under a timeout: a pass that waited on flags no prep sets would hang.
#   bench/gpu/kda_overlap_ab.sh OUTDIR
set -u
out=${1:?usage: kda_overlap_ab.sh OUTDIR}
mkdir -p "$out"
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/gpu.txt" 2>&1
(nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. -Xcudafe=--diag_suppress=2810 \
  bench/gpu/kda_gpu_bench.cu kernels/cuda/kda/chunk_prefill.cu kernels/cuda/kda/decode.cu \
  -o /tmp/kda_gpu_bench >"$out/bench_build.log" 2>&1; echo "bench build rc=$?") &
bash bench/gpu/build_gpu.sh "$out/build.log" kernels_cuda_test
wait
timeout 100 build/gpu/kernels/cuda/kernels_cuda_test --gtest_filter='KdaChunkPrefill*:KdaContextParallel*:-*Timing' \
  >"$out/tests.log" 2>&1
echo "KdaChunkPrefill* / KdaContextParallel*: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED' "$out/tests.log" | head -5
for round in 1 2; do
  for mode in default overlap; do
    for t in 4096 16384 65536; do
      pass=""  # empty: the default choice (kAuto)
      [[ $mode == overlap ]] && pass=overlap
      DELTASERVE_KDA_STATE_PASS=$pass timeout 30 /tmp/kda_gpu_bench "h=32,t=$t" >>"$out/$mode.jsonl" 2>>"$out/$mode.err"
      echo "round $round $mode T=$t rc=$? $(tail -1 "$out/$mode.jsonl" | grep -o '"ms": [0-9.]*')"
    done
  done
done
echo "total $(($(date +%s) - start)) s"
