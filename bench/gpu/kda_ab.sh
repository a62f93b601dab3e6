#!/usr/bin/env bash
# GPU machine only, from the repo root: the KDA chunked prefill of several source trees side by side in one run, so
# that a change is read against the same GPU state. Each tree is a directory holding at least kernels/, bench/ and
# common/ (the repo root itself, or a `git archive REF kernels bench common | tar -x -C DIR` made before the call);
# NAME=DIR pairs, the first one the baseline. For each tree: kda_gpu_bench built with nvcc, both kernels' times under
# Nsight Compute at H = 32 and H = 96 (T = 16k, twice, in alternation with the other trees), then the whole prefill
# cases (`kda_gpu_bench prefill`). TESTS=1 also builds kernels_cuda_test in build/gpu from the repo root and runs the
# Kda GPU cases (the root tree's code only).
#   bench/gpu/kda_ab.sh OUTDIR main=. candidate=.devsrc/candidate
# Environment: NVCC_FLAGS (added to every build, e.g. -DSOME_SWITCH=1 for a macro-guarded variant), REPEATS (2).
set -uo pipefail
out=${1:?usage: kda_ab.sh OUTDIR NAME=DIR...}
shift
mkdir -p "$out"
root=$(pwd)
flags=(-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcudafe=--diag_suppress=2810 ${NVCC_FLAGS:-})
if [[ "${TESTS:-0}" == 1 ]]; then
  (cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
    -DDELTASERVE_BENCH=OFF >"$out/tests_build.log" 2>&1 &&
    cmake --build build/gpu -j8 --target kernels_cuda_test >>"$out/tests_build.log" 2>&1) &
  tests_pid=$!
fi
names=()
builds=()
for pair in "$@"; do
  name=${pair%%=*} dir=${pair#*=}
  names+=("$name")
  (cd "$dir" && nvcc "${flags[@]}" -I. bench/gpu/kda_gpu_bench.cu kernels/cuda/kda/chunk_prefill.cu \
    kernels/cuda/kda/decode.cu -o "$out/bench_$name" >"$out/build_$name.log" 2>&1 ||
    echo "build of $name failed: $(tail -3 "$out/build_$name.log")") &
  builds+=($!)
done
wait "${builds[@]}"
metric=gpu__time_duration.sum
for repeat in $(seq "${REPEATS:-2}"); do
  for name in "${names[@]}"; do
    [[ -x "$out/bench_$name" ]] || continue
    for heads in 32 96; do
      times=$(timeout 90 ncu --clock-control none -k regex:kda_chunk -c 2 --metrics $metric "$out/bench_$name" \
        h=$heads 2>&1 | awk '/kda_chunk_prep/ {k = "prep"} /kda_chunk_state/ {k = "state"}
          /gpu__time_duration/ {v = $NF; if ($(NF-1) == "ms") v *= 1000; printf "%s %.1f us  ", k, v}')
      echo "repeat $repeat  $name  H=$heads  $times"
    done
  done
done
for name in "${names[@]}"; do
  [[ -x "$out/bench_$name" ]] || continue
  timeout 120 "$out/bench_$name" prefill >"$out/prefill_$name.jsonl" 2>"$out/prefill_$name.err"
done
python3 bench/gpu/prefill_compare.py "$out" "${names[@]}"
if [[ -n "${tests_pid:-}" ]]; then
  wait "$tests_pid" || echo "kernels_cuda_test build failed: $(tail -5 "$out/tests_build.log")"
  timeout 200 ctest --test-dir build/gpu -L gpu -R Kda -E Timing -j8 --timeout 120 >"$out/tests.log" 2>&1
  echo "Kda GPU tests: rc=$? $(grep -E 'tests passed' "$out/tests.log")"
  grep -E "\(Failed\)|\(Timeout\)|Exception" "$out/tests.log" | head -20
fi
