#!/usr/bin/env bash
# GPU machine only, from the repo root: builds the CUDA KDA kernels and their benchmark, runs the KDA tests (ctest
# label gpu), then the benchmark side by side with fla-core (carried as .whl/) and the ceilings of the same run.
#   bench/gpu/kda.sh OUTDIR COMMIT DATE [MACHINE (default nvidia-h200)]
# Results: OUTDIR/tests.log, OUTDIR/ours.jsonl, OUTDIR/peer.jsonl and OUTDIR/kda_gpu.jsonl in the bench/results
# format (append it to bench/results/kda_gpu.jsonl).
set -uo pipefail
out=${1:-/tmp/kda-out}
commit=${2:-unknown}
date=${3:-unknown}
machine=${4:-nvidia-h200}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv >"$out/gpu.txt" 2>&1
cat "$out/gpu.txt"
echo "== build"
cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=ON >"$out/build.log" 2>&1 &&
  cmake --build build/gpu -j16 --target kernels_cuda_test kda_gpu_bench >>"$out/build.log" 2>&1 || {
  tail -40 "$out/build.log"
  exit 1
}
echo "== tests"
timeout 240 ctest --test-dir build/gpu -L gpu -R '^(Kda|OpsKda)' --output-on-failure >"$out/tests.log" 2>&1
echo "ctest rc=$?"
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|\(SEGFAULT\)" "$out/tests.log" | head -40
echo "== bench (ours)"
timeout 150 build/gpu/bench/gpu/kda_gpu_bench >"$out/ours.jsonl" 2>"$out/ours.err"
echo "ours rc=$?"; cat "$out/ours.jsonl" "$out/ours.err"
echo "== bench (ceilings + fla)"
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
PYTHONPATH=$site timeout 300 python3 bench/gpu/kda_fla_peer.py >"$out/peer.jsonl" 2>"$out/peer.err"
echo "peer rc=$?"; cat "$out/peer.jsonl"; tail -5 "$out/peer.err"
python3 bench/gpu/kda_report.py "$out/ours.jsonl" "$out/peer.jsonl" "$machine" "$commit" "$date" \
  "bench/gpu/kda.sh" >"$out/kda_gpu.jsonl" && echo "report ok"
