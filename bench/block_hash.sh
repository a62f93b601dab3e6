#!/usr/bin/env bash
# Block-hash throughput (GB/s of token ids) vs the memcpy bandwidth measured in the same run;
# appends JSON lines to bench/results/block_hash.jsonl (date, commit, machine, command).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --preset release >/dev/null
cmake --build --preset release --target block_hash_bench >/dev/null
machine=${DELTASERVE_MACHINE:-"cpu-$(nproc)core-$(uname -m)"}
raw=$(mktemp)
build/release/bench/block_hash_bench --benchmark_format=json --benchmark_repetitions=5 \
  --benchmark_report_aggregates_only=true >"$raw"
python3 - "$raw" "$machine" "$(git rev-parse --short HEAD)" <<'PY' | tee -a bench/results/block_hash.jsonl
import datetime, json, sys
raw, machine, commit = sys.argv[1:4]
medians = [b for b in json.load(open(raw))["benchmarks"] if b.get("aggregate_name") == "median"]
ceiling = next(b["bytes_per_s"] for b in medians if b["run_name"].startswith("BM_MemcpyCeiling"))
common = {"machine": machine, "commit": commit, "date": datetime.date.today().isoformat(),
          "command": "bench/block_hash.sh", "peer": None, "peer_value": None, "ratio_to_peer": None}
print(json.dumps({"bench": "memcpy_ceiling", "case": "64 MiB", "metric": "bandwidth",
                  "value": round(ceiling / 1e9, 2), "unit": "GB/s", "limit": None, "ratio_to_limit": None, **common}))
for b in medians:
    if not b["run_name"].startswith("BM_HashPrompt"):
        continue
    tokens = b["run_name"].split("/")[1]
    print(json.dumps({"bench": "block_hash", "case": f"SipHash-2-4-128,block=512,T={tokens}", "metric": "throughput",
                      "value": round(b["bytes_per_s"] / 1e9, 3), "unit": "GB/s",
                      "limit": round(ceiling / 1e9, 2), "ratio_to_limit": round(b["bytes_per_s"] / ceiling, 4),
                      **common}))
PY
rm -f "$raw"
