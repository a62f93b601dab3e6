#!/usr/bin/env bash
# GPU machine only, from the repo root: Nsight Compute on the KDA prefill's two state passes (T = 16k), to see which
# pipe sets a chunk's ~1.16 us (bench/gpu/NOTES.md, "The state pass per head"): the pass per head at H = 96, the pass
# per slice at H = 32, then the pass per head's instruction-level stall samples (bench/gpu/sass_hotspots.py).
# About two minutes with the build.
#   bench/gpu/kda_state_profile.sh OUTDIR
set -uo pipefail
out=${1:?usage: kda_state_profile.sh OUTDIR}
mkdir -p "$out" build
start=$(date +%s)
nvcc -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a -I. -Xcudafe=--diag_suppress=2810 \
  bench/gpu/kda_gpu_bench.cu kernels/cuda/kda/chunk_prefill.cu kernels/cuda/kda/decode.cu \
  -o build/kda_bench_lineinfo >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
echo "built at $(($(date +%s) - start)) s"
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats"
pattern='Duration|Compute \(SM\) Throughput|Memory Throughput|Executed Ipc Active|Issue Slots Busy|SM Busy|'
pattern+='Warp Cycles Per Issued|No Eligible|Active Warps Per|Eligible Warps|Stall|Tensor|pipe'
for run in "head 96 kda_chunk_state_head" "slice 32 kda_chunk_state_kernel"; do
  set -- $run
  DELTASERVE_KDA_STATE_PASS=$1 timeout 60 ncu --clock-control none -k "regex:$3" -c 1 $sections \
    build/kda_bench_lineinfo h=$2 >"$out/ncu_$1.txt" 2>&1
  echo "== $1 H=$2 (rc=$?, $(($(date +%s) - start)) s)"
  grep -E "$pattern" "$out/ncu_$1.txt" | sed 's/  */ /g' | cut -c1-120 | head -40
done
DELTASERVE_KDA_STATE_PASS=head timeout 60 ncu --clock-control none --section WarpStateStats --section SourceCounters \
  -k regex:kda_chunk_state_head -c 1 --page source --print-source sass --csv build/kda_bench_lineinfo h=96 \
  >"$out/sass_head.csv" 2>"$out/sass_head.err"
echo "== head: hottest instructions ($(($(date +%s) - start)) s)"
python3 bench/gpu/sass_hotspots.py "$out/sass_head.csv" 25 | cut -c1-170
echo "total $(($(date +%s) - start)) s"
