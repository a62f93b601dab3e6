"""Records of one bench/gpu/mla_v3_trace_bench run for bench/results/kernels_gpu.jsonl.

usage: mla_trace_records.py TRACE_TXT SETTING COMMIT DATE COMMAND > records.jsonl
TRACE_TXT: what mla_v3_trace_bench printed (bench/gpu/mla_v3_trace.sh writes trace_0.txt, trace_2.txt). Per shape
(batch, context) it gives `mla_decode_timeline` records, every time in us from the first attention CTA's start:
the attention's last store, the split-K combine's last end, the combine's end past the attention (the value that
adds to a decode step), how many combine CTAs started only after the attention's last store, and per tile the
medians of each step of its chain (issue -> in -> P -> done; release -> producer woke -> issued; in -> scores ->
maxima -> P).
"""
import json
import re
import sys


def main():
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    path, setting, commit, date, command = sys.argv[1:]
    shape = None
    out = []

    def record(metric, value, unit, note=None):
        out.append({
            "bench": "mla_decode_timeline",
            "case": f"kimi-linear-48b-mla,{shape},{setting}" + (f",{note}" if note else ""),
            "metric": metric, "value": value, "unit": unit, "limit": None, "ratio_to_limit": None, "peer": None,
            "peer_value": None, "ratio_to_peer": None, "machine": "nvidia-h200", "commit": commit, "date": date,
            "command": command,
        })

    attention_end = None
    for line in open(path):
        m = re.match(r"B=(\d+) ctx=(\d+): (\d+) splits, (\d+) heads per CTA", line)
        if m:
            shape = f"B={m[1]},ctx={m[2]},splits={m[3]},group={m[4]}"
            continue
        m = re.search(r"q ready ([\d.]+), last store ([\d.]+) \(max ([\d.]+)\)", line)
        if m and shape:
            record("attention_q_ready", float(m[1]), "us")
            record("attention_last_store", float(m[3]), "us")
            attention_end = float(m[3])
            continue
        # Per tile (medians over the CTAs): issue -> data in -> P handed over -> warpgroup 1 done, and (39fbd41) the
        # stage's release -> producer past its wait -> copies issued, data in -> scores -> maxima -> P.
        m = re.match(r"\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+ \|\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", line)
        if m and shape:
            for metric, value in zip(("tile_issue_to_in", "tile_in_to_p", "tile_p_to_done"), m.groups()[1:]):
                record(metric, float(value), "us", f"tile {m[1]}")
            continue
        m = re.match(r"\s+(\d+) \|\s+(nan|[\d.]+)\s+([\d.]+) \|\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", line)
        if m and shape:
            names = ("tile_release_to_woke", "tile_woke_to_issued", "tile_in_to_scores", "tile_scores_to_max",
                     "tile_max_to_p")
            for metric, value in zip(names, m.groups()[1:]):
                if value != "nan":
                    record(metric, float(value), "us", f"tile {m[1]}")
            continue
        m = re.search(r"combine: attention's last store [\d.]+; (\d+) CTAs started before it, (\d+) after", line)
        if m and shape:
            record("combine_ctas_started_after_attention", int(m[2]), "CTAs")
            continue
        m = re.search(r"(first|second) wave medians:.* end ([\d.]+); last end ([\d.]+)", line)
        if m and shape:
            record("combine_median_end", float(m[2]), "us", f"{m[1]} wave")
            record("combine_last_end", float(m[3]), "us", f"{m[1]} wave")
            if attention_end is not None:
                record("combine_end_past_attention", round(float(m[3]) - attention_end, 2), "us", f"{m[1]} wave")
    for r in out:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
