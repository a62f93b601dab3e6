#!/usr/bin/env bash
# GPU machine only, from the repo root: the KDA prefill's two state passes side by side in one call
# (DELTASERVE_KDA_STATE_PASS: "slice" = kda_chunk_state_kernel, a CTA per value slice; "head" =
# kda_chunk_state_head_kernel, a CTA per head; unset = the launcher's choice, per head when 2 H > SMs):
#   1. the chunked-prefill and context-parallel GPU cases (each case runs both passes against the CPU reference);
#   2. both kernels' times under Nsight Compute at H = 32 and H = 96, T = 16k, under each setting (REPEATS, 1);
#   3. the whole prefill cases (`kda_gpu_bench prefill`) under each setting;
#   4. with FLA=1 (carry .whl), fla-core's chunk_kda at H = 96 in the same call (bench/gpu/kda_fla_peer.py h96).
#   bench/gpu/kda_state_pass_ab.sh OUTDIR
set -uo pipefail
out=${1:?usage: kda_state_pass_ab.sh OUTDIR}
mkdir -p "$out" build
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv >"$out/gpu.txt" 2>&1
flags=(-std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Xcudafe=--diag_suppress=2810 -I.)
(cmake -S . -B build/gpu -G Ninja -DDELTASERVE_ENGINE_ONLY=ON -DDELTASERVE_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
  -DDELTASERVE_BENCH=OFF >"$out/tests_build.log" 2>&1 &&
  cmake --build build/gpu -j12 --target kernels_cuda_test >>"$out/tests_build.log" 2>&1 ||
  echo "kernels_cuda_test build failed: $(tail -5 "$out/tests_build.log")") &
(nvcc "${flags[@]}" bench/gpu/kda_gpu_bench.cu kernels/cuda/kda/chunk_prefill.cu kernels/cuda/kda/decode.cu \
  -o build/kda_bench >"$out/bench_build.log" 2>&1 || echo "kda_gpu_bench build failed: $(tail -3 "$out/bench_build.log")") &
if [[ "${FLA:-0}" == 1 ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    >"$out/pip.log" 2>&1 &
fi
wait
echo "built at $(($(date +%s) - start)) s"
settings="slice head"
timeout 200 build/gpu/kernels/cuda/kernels_cuda_test --gtest_filter='KdaChunkPrefillGpu.*:KdaContextParallel*' \
  >"$out/tests.log" 2>&1
echo "tests: rc=$? $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/tests.log" | tr '\n' ' ')"
grep -E "^\[  FAILED  \]|Failure" "$out/tests.log" | head -12 | cut -c1-220
grep -E "^\[ kda prefill \].*pass=head" "$out/tests.log" | tail -4 | cut -c1-160
metric=gpu__time_duration.sum
for repeat in $(seq "${REPEATS:-1}"); do
  for setting in $settings; do
    for heads in 32 96; do
      times=$(DELTASERVE_KDA_STATE_PASS=$setting timeout 90 ncu --clock-control none -k regex:kda_chunk -c 2 \
        --metrics $metric build/kda_bench h=$heads 2>&1 |
        awk '/kda_chunk_prep/ {k = "prep"} /kda_chunk_state/ {k = "state"}
          /gpu__time_duration/ {v = $NF; if ($(NF-1) == "ms") v *= 1000; printf "%s %.1f us  ", k, v}')
      echo "repeat $repeat  $setting  H=$heads  $times"
    done
  done
done
for setting in $settings; do
  DELTASERVE_KDA_STATE_PASS=$setting timeout 120 build/kda_bench prefill >"$out/prefill_$setting.jsonl" \
    2>"$out/prefill_$setting.err"
done
python3 bench/gpu/prefill_compare.py "$out" $settings
if [[ "${FLA:-0}" == 1 ]]; then
  PYTHONPATH=/tmp/site timeout 240 python3 bench/gpu/kda_fla_peer.py h96 >"$out/peer.jsonl" 2>"$out/peer.err"
  echo "fla rc=$? at $(($(date +%s) - start)) s"
  cut -c1-200 "$out/peer.jsonl"
  tail -3 "$out/peer.err"
fi
echo "total $(($(date +%s) - start)) s"
