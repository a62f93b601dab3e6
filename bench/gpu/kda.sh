#!/usr/bin/env bash
# GPU machine only, from the repo root: builds the CUDA KDA kernels, runs their tests (ctest label gpu), then the
# benchmark side by side with fla-core (carried as .whl/) and the ceilings of the same run.
#   bench/gpu/kda.sh OUTDIR COMMIT DATE
# Results: OUTDIR/tests.log, OUTDIR/ours.jsonl, OUTDIR/peer.jsonl, OUTDIR/kda_gpu.jsonl (bench/results format).
set -uo pipefail
out=${1:-/tmp/kda-out}
commit=${2:-unknown}
date=${3:-unknown}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
echo "== build"
cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=OFF >"$out/build.log" 2>&1
cmake --build build/gpu -j16 --target kernels_cuda_test >>"$out/build.log" 2>&1 || tail -40 "$out/build.log"
nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I. -Xcudafe=--diag_suppress=2810 \
  bench/gpu/kda_gpu_bench.cu kernels/cuda/kda/chunk_prefill.cu kernels/cuda/kda/decode.cu \
  -o build/gpu/kda_gpu_bench >>"$out/build.log" 2>&1 || tail -20 "$out/build.log"
echo "== tests"
if [[ -x build/gpu/kernels/cuda/kernels_cuda_test ]]; then
  timeout 240 ctest --test-dir build/gpu -L gpu --output-on-failure -V >"$out/tests.log" 2>&1
  echo "ctest rc=$?"
else  # the CMake configure failed (other modules mid-edit): build the same test binary by hand
  echo "cmake build failed; building kernels_cuda_test directly"
  nvcc -std=c++20 -O2 -gencode=arch=compute_90a,code=sm_90a -I. -Xcudafe=--diag_suppress=2810 kernels/cuda/*.cu \
    kernels/cuda/*_test.cpp $(ls kernels/cpu/*.cpp | grep -v _test) -lgtest -lgtest_main -lpthread \
    -o build/gpu/kernels_cuda_test_direct >>"$out/build.log" 2>&1 || tail -20 "$out/build.log"
  timeout 240 build/gpu/kernels_cuda_test_direct >"$out/tests.log" 2>&1
  echo "direct test rc=$?"
fi
grep -E "^\S*\s*\[ kda|tests passed|Failed|FAILED|Expected|Which is|actual" "$out/tests.log" | sed 's/^[0-9]*: //' | head -60
echo "== bench (ours)"
timeout 150 build/gpu/kda_gpu_bench >"$out/ours.jsonl" 2>"$out/ours.err"
echo "ours rc=$?"; cat "$out/ours.jsonl" "$out/ours.err"
echo "== bench (ceilings + fla)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
PYTHONPATH=/tmp/site timeout 300 python3 bench/gpu/kda_fla_peer.py >"$out/peer.jsonl" 2>"$out/peer.err"
echo "peer rc=$?"; cat "$out/peer.jsonl"; tail -5 "$out/peer.err"
python3 bench/gpu/kda_report.py "$out/ours.jsonl" "$out/peer.jsonl" nvidia-h200 "$commit" "$date" \
  "bench/gpu/kda.sh" >"$out/kda_gpu.jsonl" && echo "report ok"
