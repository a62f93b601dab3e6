#!/usr/bin/env python3
"""Side-by-side whole-prefill times of several `kda_gpu_bench prefill` runs of one device call.

usage: prefill_compare.py OUTDIR NAME... (reads OUTDIR/prefill_NAME.jsonl; the first NAME is the baseline, the
others are printed with baseline / theirs, so > 1 means faster than the baseline)
"""
import json
import sys


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__.strip())
    out, names = sys.argv[1], sys.argv[2:]
    runs = {}
    for name in names:
        try:
            with open(f"{out}/prefill_{name}.jsonl") as f:
                runs[name] = {r["case"]: r["ms"] for r in map(json.loads, f) if r.get("kind") == "prefill"}
        except (OSError, ValueError) as e:
            print(f"{name}: no prefill results ({e})")
    base = runs.get(names[0], {})
    for case, ms in base.items():
        cells = "".join(f"  {n} {runs[n][case]:.4f} ({ms / runs[n][case]:.3f}x)" for n in names[1:]
                        if case in runs.get(n, {}))
        print(f"{case[:60]:60s} ms: {names[0]} {ms:.4f}{cells}")


if __name__ == "__main__":
    main()
