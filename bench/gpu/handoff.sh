#!/usr/bin/env bash
# GPU host only: the transfer engine's bandwidth between two processes on one GPU, GPU memory to GPU memory,
# beside the peer `ucx_perftest -t ucp_put_bw -m cuda,cuda` on the same UCX and UCX_TLS, in one run.
#   bench/gpu/handoff.sh OUTDIR BUNDLE UCX COMMIT DATE MACHINE [TLS (default sm,cuda_copy,cuda_ipc)]
# BUNDLE: ucx_transfer_bench built with CUDA on the build host, in BUNDLE/bin with its libraries in BUNDLE/lib
# (shared/tools/bundle-libs.sh); UCX: an unpacked CUDA-enabled UCX (PyPI libucx-cu13's libucx/ folder: lib/,
# bin/ucx_perftest, with the wheel's libucx_cu13.libs/ beside it: its CUDA runtime and OpenMP), whose libraries go
# first on the library path, so the Debian-built binary runs on it.
# Output: OUTDIR/ours.jsonl, OUTDIR/perftest.txt, OUTDIR/handoff_gpu.jsonl (bench/results lines).
set -uo pipefail
out=$1 bundle=$2 ucx=$3 commit=$4 date=$5 machine=$6 tls=${7:-sm,cuda_copy,cuda_ipc}
mkdir -p "$out"
export LD_LIBRARY_PATH="$ucx/lib:$ucx/../libucx_cu13.libs:$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/gpu.txt" 2>&1
"$ucx/bin/ucx_info" -v >"$out/ucx.txt" 2>&1
"$ucx/bin/ucx_info" -d 2>/dev/null | grep -E "Transport|memory types" >>"$out/ucx.txt"
: >"$out/perftest.txt"
for mib in 4 16 64; do
  bytes=$((mib << 20))
  port=$((20000 + mib))
  UCX_TLS=$tls "$ucx/bin/ucx_perftest" -t ucp_put_bw -m cuda,cuda -s $bytes -n 200 -w 20 -p $port >/dev/null 2>&1 &
  server=$!
  sleep 1
  final=$(UCX_TLS=$tls timeout 120 "$ucx/bin/ucx_perftest" 127.0.0.1 -t ucp_put_bw -m cuda,cuda -s $bytes -n 200 \
    -w 20 -p $port 2>&1 | tee -a "$out/perftest.log" | grep -E "^Final:")
  wait $server
  echo "$mib $final" | tee -a "$out/perftest.txt"
done
timeout 300 "$bundle/bin/ucx_transfer_bench" --memory cuda --tls "$tls" --iters 9 --warmup 3 \
  --cases pieces_4m_x32,pieces_16m_x16,pieces_64m_x8,kda_state_48b,mla_pages_48b_32k >"$out/ours.jsonl" 2>"$out/ours.err"
echo "ours rc=$?"
cat "$out/ours.jsonl" "$out/ours.err"
python3 "$(dirname "$0")/handoff_report.py" "$out/ours.jsonl" "$out/perftest.txt" "$machine" "$commit" "$date" \
  "bench/gpu/handoff.sh ($tls)" "$("$ucx/bin/ucx_info" -v | sed -n "s/.*Library version: //p" | head -1)" >"$out/handoff_gpu.jsonl" && cat "$out/handoff_gpu.jsonl"
