"""Joins bench/gpu/kda_gpu_bench (ours) and kda_fla_peer.py (ceilings, fla) output into bench/results JSON lines.

usage: kda_report.py OURS.jsonl PEER.jsonl MACHINE COMMIT DATE COMMAND > kda_gpu.jsonl
limit = max(bytes / copy bandwidth, FLOPs / GEMM rate) for prefill; bytes / copy bandwidth for decode.
ratio_to_limit = limit / time; ratio_to_peer = peer time / our time.
"""
import json
import sys


def load(path):
    rows = []
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            rows.append(json.loads(line))
    return rows


def main():
    ours, peer = load(sys.argv[1]), load(sys.argv[2])
    machine, commit, date, command = sys.argv[3:7]
    copy = next(r["value"] for r in peer if r.get("name") == "copy")  # TB/s
    gemm = next(r["value"] for r in peer if r.get("name") == "gemm")  # TFLOP/s
    peer_name = next((r["name"] for r in peer if r.get("kind") == "peer"), None)
    fla = {(r["kind"], r["case"]): r for r in peer if r.get("kind") in ("prefill", "decode")}
    base = {"machine": machine, "commit": commit, "date": date, "command": command}

    def line(**kw):
        out = {k: kw.get(k) for k in ("bench", "case", "metric", "value", "unit", "limit", "ratio_to_limit", "peer",
                                      "peer_value", "ratio_to_peer")}
        out.update(base)
        print(json.dumps(out))

    line(bench="gpu_copy_ceiling", case="device-to-device copy 2 GiB, bytes read+written", metric="bandwidth",
         value=round(copy, 3), unit="TB/s")
    line(bench="gpu_gemm_ceiling", case="torch bf16 matmul 8192^3 random", metric="throughput", value=round(gemm, 1),
         unit="TFLOP/s")
    for r in ours:
        if r["kind"] == "prefill":
            limit_ms = max(r["bytes"] / (copy * 1e12), r["flops"] / (gemm * 1e12)) * 1e3
            p = fla.get(("prefill", r["case"]))
            line(bench="kda_prefill", case=r["case"], metric="time", value=round(r["ms"], 4), unit="ms",
                 limit=round(limit_ms, 4), ratio_to_limit=round(limit_ms / r["ms"], 4),
                 peer=peer_name if p else None, peer_value=round(p["ms"], 4) if p else None,
                 ratio_to_peer=round(p["ms"] / r["ms"], 3) if p else None)
            line(bench="kda_prefill", case=r["case"], metric="tokens_per_s", value=round(r["T"] / (r["ms"] * 1e-3)),
                 unit="tokens/s")
        elif r["kind"] == "decode":
            limit_us = r["bytes"] / (copy * 1e12) * 1e6
            p = fla.get(("decode", r["case"]))
            line(bench="kda_decode", case=r["case"] + ",graph,per layer", metric="time", value=round(r["us"], 3),
                 unit="us", limit=round(limit_us, 3), ratio_to_limit=round(limit_us / r["us"], 4),
                 peer=(peer_name + " (no conv, no output norm)") if p else None,
                 peer_value=round(p["us"], 3) if p else None, ratio_to_peer=round(p["us"] / r["us"], 3) if p else None)
            line(bench="kda_decode", case=r["case"] + ",graph,per layer", metric="state_bandwidth",
                 value=round(2.0 * r["B"] * r["H"] * 128 * 128 * 4 / (r["us"] * 1e-6) / 1e12, 3), unit="TB/s",
                 limit=round(copy, 3), ratio_to_limit=round(2.0 * r["B"] * r["H"] * 65536 / (r["us"] * 1e-6) / 1e12 / copy, 4))


if __name__ == "__main__":
    main()
