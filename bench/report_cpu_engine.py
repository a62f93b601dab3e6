"""Turns Google Benchmark JSON of cpu_engine_bench into bench/results JSON lines (median of repetitions).

The CPU engine has no peer run side by side and its physical limit (fp32 FLOP/s of this CPU) is not
measured here, so `limit`/`peer` fields are null: the figures are a baseline for the CPU reference.
"""
import datetime
import json
import sys

raw, machine, commit, command = sys.argv[1:5]
data = json.load(open(raw))
for b in data["benchmarks"]:
    if b.get("aggregate_name") != "median":
        continue
    name = b["run_name"]  # e.g. BM_Prefill/tiny_linear/512
    kind, preset, arg = name.split("/")
    bench = "cpu_prefill" if kind == "BM_Prefill" else "cpu_decode"
    case = f"preset={preset.replace('_', '-')},{'T' if bench == 'cpu_prefill' else 'B'}={arg}"
    print(json.dumps({
        "bench": bench, "case": case, "metric": "throughput", "value": round(b["tokens_per_s"], 1),
        "unit": "tokens/s", "limit": None, "ratio_to_limit": None, "peer": None, "peer_value": None,
        "ratio_to_peer": None, "machine": machine, "commit": commit,
        "date": datetime.date.today().isoformat(), "command": command,
    }))
