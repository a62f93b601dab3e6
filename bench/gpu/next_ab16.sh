#!/usr/bin/env bash
# GPU machine only, from the repo root (about 6 minutes): what the overlapped KDA state pass needs before it can be
# the default (DELTASERVE_KDA_STATE_PASS=overlap; fourteenth session: 1.15-1.25x at H = 32, measured before its
# fallback for serialised kernels was added).
#   1. the chunked-prefill cases (every case runs the overlapped pass, once with no wait: the rerun after the prep);
#   2. one of them under compute-sanitizer (which may serialise kernels: the fallback must finish it, not hang);
#   3. engine_cuda_test with the overlapped pass (the 48B-shaped engine paths at H = 32 take it);
#   4. kda_gpu_bench h=32 at T = 4k / 16k / 64k, default and overlapped alternating, twice (the rerun launch's cost).
# Every process runs under a timeout.
#   bench/gpu/next_ab16.sh OUTDIR
set -u
out=${1:?usage: next_ab16.sh OUTDIR}
mkdir -p "$out"
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/gpu.txt" 2>&1
(nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. -Xcudafe=--diag_suppress=2810 \
  bench/gpu/kda_gpu_bench.cu kernels/cuda/kda_chunk_prefill.cu kernels/cuda/kda_decode.cu \
  -o /tmp/kda_gpu_bench >"$out/bench_build.log" 2>&1; echo "bench build rc=$?") &
bash bench/gpu/build_gpu.sh "$out/build.log" kernels_cuda_test engine_cuda_test
wait
tests=build/gpu/kernels/cuda/kernels_cuda_test
timeout 100 $tests --gtest_filter='KdaChunkPrefill*:KdaContextParallel*:-*Timing' >"$out/kda_tests.log" 2>&1
echo "KdaChunkPrefill* / KdaContextParallel*: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/kda_tests.log" | tr '\n' ' ')"
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
timeout 120 "$sanitizer" --tool memcheck $tests --gtest_filter='KdaChunkPrefillGpu.NoInitialState' \
  >"$out/sanitizer.log" 2>&1
echo "compute-sanitizer, KdaChunkPrefillGpu.NoInitialState: rc=$? $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED)' "$out/sanitizer.log" | tr '\n' ' ')"
DELTASERVE_KDA_STATE_PASS=overlap timeout 150 build/gpu/engine/cuda/engine_cuda_test >"$out/engine_tests.log" 2>&1
echo "engine_cuda_test, overlap: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/engine_tests.log" | tr '\n' ' ')"
for round in 1 2; do
  for mode in default overlap; do
    for t in 4096 16384 65536; do
      if [[ $mode == overlap ]]; then export DELTASERVE_KDA_STATE_PASS=overlap; else unset DELTASERVE_KDA_STATE_PASS; fi
      timeout 30 /tmp/kda_gpu_bench "h=32,t=$t" >>"$out/$mode.jsonl" 2>>"$out/$mode.err"
      echo "round $round $mode T=$t rc=$? $(tail -1 "$out/$mode.jsonl" | grep -o '"ms": [0-9.]*')"
    done
  done
done
unset DELTASERVE_KDA_STATE_PASS
echo "total $(($(date +%s) - start)) s"
