#!/usr/bin/env bash
# GPU machine only, from the repo root: configures build/gpu (engine-only, CUDA, Release) and builds the named
# targets, logging to LOG; prints the exit status and the seconds taken, and returns the status.
#   bench/gpu/build_gpu.sh LOG TARGET...
set -u
log=${1:?usage: build_gpu.sh LOG TARGET...}
shift
start=$(date +%s)
cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=OFF >"$log" 2>&1 &&
  cmake --build build/gpu -j16 --target "$@" >>"$log" 2>&1
rc=$?
echo "build rc=$rc in $(($(date +%s) - start)) s"
exit $rc
