"""Records of one decode_env_ab.sh run for bench/results/engine_gpu_ab.jsonl.

usage: ab_records.py AB_DIR COMMIT DATE COMMAND NAME... > records.jsonl
AB_DIR: the OUTDIR of bench/gpu/decode_env_ab.sh (ab1.jsonl, ab2.jsonl, ... one per setting, in order); NAME: what
each setting is called in the records' case, in the same order. Every graph-mode step time becomes an
`engine_decode_ab` record whose peer is the first setting's time for the same batch and context in the same run.
"""
import json
import sys


def main():
    if len(sys.argv) < 6:
        sys.exit(__doc__)
    ab_dir, commit, date, command, *names = sys.argv[1:]
    runs = []
    for i, name in enumerate(names, start=1):
        steps = {}
        for line in open(f"{ab_dir}/ab{i}.jsonl"):
            r = json.loads(line)
            if r["metric"] == "step_time" and r["case"].endswith(",graph"):
                _, batch, context, _ = r["case"].split(",")
                steps[(batch, context)] = r
        runs.append((name, steps))
    first_name, first = runs[0]
    for name, steps in runs:
        for key, r in steps.items():
            peer = first.get(key)
            out = {
                "bench": "engine_decode_ab",
                "case": f"kimi-linear-48b,{key[0]},{key[1]},graph,{name}",
                "metric": "step_time",
                "value": r["value"],
                "unit": r["unit"],
                "limit": r.get("limit"),
                "ratio_to_limit": r.get("ratio_to_limit"),
                "peer": f"{first_name}, same binary, same run",
                "peer_value": peer["value"] if peer else None,
                "ratio_to_peer": round(peer["value"] / r["value"], 4) if peer else None,
                "machine": "nvidia-h200",
                "commit": commit,
                "date": date,
                "command": command,
            }
            print(json.dumps(out))


if __name__ == "__main__":
    main()
