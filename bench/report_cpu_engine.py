"""Turns Google Benchmark JSON of cpu_engine_bench into bench/results JSON lines (median of repetitions).

Limit: the tokens/s the case would reach if all its matmul FLOPs (2 x active parameters per token)
ran at the fp32 matmul rate measured in the same run (BM_LinearCeiling, 512^3). No peer CPU engine
for this model family is run side by side, so the peer fields are null.
"""
import datetime
import json
import sys

raw, machine, commit, command = sys.argv[1:5]
data = json.load(open(raw))
medians = [b for b in data["benchmarks"] if b.get("aggregate_name") == "median"]
ceiling = next(b["flops_per_s"] for b in medians if b["run_name"].startswith("BM_LinearCeiling"))
common = {"machine": machine, "commit": commit, "date": datetime.date.today().isoformat(), "command": command}
print(json.dumps({"bench": "cpu_matmul_ceiling", "case": "fp32 linear 512x512x512", "metric": "throughput",
                  "value": round(ceiling / 1e9, 2), "unit": "GFLOP/s", "limit": None, "ratio_to_limit": None,
                  "peer": None, "peer_value": None, "ratio_to_peer": None, **common}))
for b in medians:
    name = b["run_name"]  # e.g. BM_Prefill/tiny_linear/512
    if name.startswith("BM_LinearCeiling"):
        continue
    kind, preset, arg = name.split("/")
    bench = "cpu_prefill" if kind == "BM_Prefill" else "cpu_decode"
    case = f"preset={preset.replace('_', '-')},{'T' if bench == 'cpu_prefill' else 'B'}={arg}"
    limit = ceiling / b["flops_per_token"]
    print(json.dumps({
        "bench": bench, "case": case, "metric": "throughput", "value": round(b["tokens_per_s"], 1),
        "unit": "tokens/s", "limit": round(limit, 1), "ratio_to_limit": round(b["tokens_per_s"] / limit, 4),
        "peer": None, "peer_value": None, "ratio_to_peer": None, **common,
    }))
