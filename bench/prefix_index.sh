#!/usr/bin/env bash
# Router prefix index (RocksDB): lookups/s and p99 lookup latency for 4k- and 128k-token prompts (full-depth
# hits and misses after a few blocks) over ~100k entries, and apply() events/s; the limit is the same work
# on an in-memory std::unordered_map measured in the same run. Appends JSON lines to
# bench/results/prefix_index.jsonl (date, commit, machine, command, load average).
# DELTASERVE_BUILD_DIR: build directory to use instead of the release preset's build/release.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${DELTASERVE_BUILD_DIR:-build/release}
if [[ "$build" == build/release ]]; then
  cmake --preset release >/dev/null
else
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
fi
cmake --build "$build" --target prefix_index_bench >/dev/null
machine=${DELTASERVE_MACHINE:-"cpu-$(nproc)core-$(uname -m)"}
raw=$(mktemp)
load_before=$(cut -d' ' -f1 /proc/loadavg)
"$build"/bench/prefix_index_bench --benchmark_format=json --benchmark_repetitions=5 \
  --benchmark_report_aggregates_only=true >"$raw"
python3 - "$raw" "$machine" "$(git rev-parse --short HEAD)" "$load_before" <<'PY' | tee -a bench/results/prefix_index.jsonl
import datetime, json, sys
raw, machine, commit, load_before = sys.argv[1:5]
medians = {b["run_name"]: b for b in json.load(open(raw))["benchmarks"] if b.get("aggregate_name") == "median"}
common = {"machine": machine, "commit": commit, "date": datetime.date.today().isoformat(),
          "command": "bench/prefix_index.sh", "peer": None, "peer_value": None, "ratio_to_peer": None,
          "load_average_before": float(load_before)}
def line(bench, case, metric, value, unit, limit, ratio):
    print(json.dumps({"bench": bench, "case": case, "metric": metric, "value": round(value, 3), "unit": unit,
                      "limit": round(limit, 3), "ratio_to_limit": round(ratio, 4), **common}))
for blocks, tokens in ((8, "4k"), (256, "128k")):
    for hit, shape in ((1, "hit at full depth"), (0, "miss after 2 blocks" if blocks == 8 else "miss after 4 blocks")):
        ours = medians[f"BM_IndexLookup/{blocks}/{hit}/real_time"]
        ceiling = medians[f"BM_MapLookupCeiling/{blocks}/{hit}/real_time"]
        case = f"prompt={tokens} tokens ({blocks} blocks),{shape},entries={int(ours['entries'])},workers=8"
        line("prefix_index_lookup", case, "throughput", ours["lookups_per_s"], "lookups/s",
             ceiling["lookups_per_s"], ours["lookups_per_s"] / ceiling["lookups_per_s"])
        line("prefix_index_lookup", case, "p99_latency", ours["p99_us"], "us", ceiling["p99_us"],
             ceiling["p99_us"] / ours["p99_us"])
ceiling = medians["BM_MapApplyCeiling/real_time"]["events_per_s"]
for sync in (0, 1):
    ours = medians[f"BM_IndexApply/{sync}/real_time"]["events_per_s"]
    line("prefix_index_apply", f"8 kStored events per batch,sync_writes={'true' if sync else 'false'}",
         "throughput", ours, "events/s", ceiling, ours / ceiling)
PY
rm -f "$raw"
