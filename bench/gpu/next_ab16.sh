#!/usr/bin/env bash
# GPU machine only, from the repo root (about 6 minutes): what the overlapped KDA state pass needs before it can be
# the default (DELTASERVE_KDA_STATE_PASS=overlap; fourteenth session: 1.15-1.25x at H = 32, measured before its
# fallback for serialised kernels was added).
#   1. bench/gpu/kda_overlap_ab.sh: the chunked-prefill cases (every case runs the overlapped pass, once with no
#      wait: the rerun after the prep) and the A/B against the default at H = 32 (now with the rerun launch);
#   2. one case under compute-sanitizer (which may serialise kernels: the fallback must finish it, not hang);
#   3. engine_cuda_test with the overlapped pass (its 128-dim KDA configs take the chunked prefill).
# Every process runs under a timeout.
#   bench/gpu/next_ab16.sh OUTDIR
set -u
out=${1:?usage: next_ab16.sh OUTDIR}
start=$(date +%s)
bash bench/gpu/kda_overlap_ab.sh "$out/ab"
bash bench/gpu/build_gpu.sh "$out/engine_build.log" engine_cuda_test
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
timeout 120 "$sanitizer" --tool memcheck build/gpu/kernels/cuda/kernels_cuda_test \
  --gtest_filter='KdaChunkPrefillGpu.NoInitialState' >"$out/sanitizer.log" 2>&1
echo "compute-sanitizer, KdaChunkPrefillGpu.NoInitialState: rc=$? $(grep -E 'ERROR SUMMARY|^\[  (PASSED|FAILED)' "$out/sanitizer.log" | tr '\n' ' ')"
DELTASERVE_KDA_STATE_PASS=overlap timeout 150 build/gpu/engine/cuda/engine_cuda_test >"$out/engine_tests.log" 2>&1
echo "engine_cuda_test, overlap: rc=$? $(grep -E '^\[  (PASSED|FAILED)' "$out/engine_tests.log" | tr '\n' ' ')"
echo "total $(($(date +%s) - start)) s"
