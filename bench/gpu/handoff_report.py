"""Joins ucx_transfer_bench --memory cuda (ours) and ucx_perftest ucp_put_bw (peer) output into bench/results lines.

usage: handoff_report.py OURS.jsonl PERFTEST.txt MACHINE COMMIT DATE COMMAND UCX_VERSION > handoff_gpu.jsonl
PERFTEST.txt: one line per size, "<MiB> Final: iters p50 avg overall bw_avg bw_overall msgs_avg msgs_overall",
bandwidth in MB/s of 2^20 bytes. The limit of a transfer between two processes on one GPU is its device-to-device
copy: each byte moved is read and written once, so limit = copy traffic / 2 (measured by ours in the same run).
ratio_to_peer = ours / ucx_perftest at the same piece size.
"""
import json
import sys


def main():
    ours_path, perf_path, machine, commit, date, command, ucx_version = sys.argv[1:8]
    ours = [json.loads(l) for l in open(ours_path) if l.startswith("{")]
    peer = {}
    for line in open(perf_path):
        parts = line.split()
        if len(parts) >= 8 and parts[1] == "Final:":
            peer[int(parts[0])] = float(parts[7]) * 2**20 / 1e9  # overall bandwidth, GB/s
    gpu = next(r for r in ours if r["kind"] == "checksum_gpu")
    limit = gpu["d2d_copy_traffic_gbps"] / 2
    base = {"machine": machine, "commit": commit, "date": date, "command": command}

    def emit(**kw):
        row = {k: kw.get(k) for k in ("bench", "case", "metric", "value", "unit", "limit", "ratio_to_limit", "peer",
                                      "peer_value", "ratio_to_peer")}
        row.update(base)
        print(json.dumps(row))

    emit(bench="gpu_sum64", case="256 MiB on one GPU (bytes read)", metric="throughput",
         value=round(gpu["checksum_gbps"], 1), unit="GB/s", limit=round(gpu["d2d_copy_traffic_gbps"], 1),
         ratio_to_limit=round(gpu["checksum_gbps"] / gpu["d2d_copy_traffic_gbps"], 3))
    for r in ours:
        if r["kind"] != "transfer":
            continue
        case = f'{r["case"]} ({r["bytes"]} B, {r["pieces"]} pieces, {r["segments"]} segments, GPU to GPU, two processes)'
        mib = None
        if r["case"].startswith("pieces_"):
            mib = int(r["case"].split("_")[1].rstrip("m"))
        peer_value = peer.get(mib)
        emit(bench="handoff_gpu", case=case, metric="bandwidth", value=round(r["gbps"], 2), unit="GB/s",
             limit=round(limit, 1), ratio_to_limit=round(r["gbps"] / limit, 3),
             peer=f"ucx_perftest {ucx_version} ucp_put_bw -m cuda,cuda -s {mib} MiB" if peer_value else None,
             peer_value=round(peer_value, 2) if peer_value else None,
             ratio_to_peer=round(r["gbps"] / peer_value, 3) if peer_value else None)


if __name__ == "__main__":
    main()
