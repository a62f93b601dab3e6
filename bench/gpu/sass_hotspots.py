"""Where a kernel's warps stall, instruction by instruction, from Nsight Compute's source page.

usage: sass_hotspots.py SOURCE.csv [TOP]
SOURCE.csv: `ncu --section WarpStateStats --section SourceCounters -k regex:KERNEL -c 1 --page source
--print-source sass --csv APP ARGS > SOURCE.csv` (build the app with -lineinfo). Prints the stall reasons summed over
the kernel, then the TOP (default 40) instructions by warp-stall samples, in program order, each with its share of
all samples, how often it ran, and its two largest stall reasons: a stall is charged to the instruction that waits,
so a hot instruction right after a barrier, a wgmma wait or a load names what the warps were waiting for.
"""
import csv
import sys


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    rows = list(csv.reader(open(sys.argv[1])))
    header_at = next((i for i, row in enumerate(rows) if "Source" in row), None)
    if header_at is None:
        sys.exit(f"sass_hotspots: {sys.argv[1]} has no 'Source' column (not an ncu --page source --csv export)")
    header, body = rows[header_at], [row for row in rows[header_at + 1:] if len(row) == len(rows[header_at])]
    source = header.index("Source")
    samples = header.index("Warp Stall Sampling (All Samples)")
    executed = header.index("Instructions Executed") if "Instructions Executed" in header else None
    reasons = [i for i, name in enumerate(header) if name.startswith("stall_") and "(Not Issued)" not in name]
    total = sum(number(row[samples]) for row in body)
    if total == 0:
        sys.exit("sass_hotspots: no stall samples (was WarpStateStats/SourceCounters collected?)")
    print(f"{len(body)} instructions, {total:.0f} warp-stall samples")
    by_reason = sorted(((sum(number(row[i]) for row in body), header[i]) for i in reasons), reverse=True)
    print("stall reasons: " + ", ".join(f"{name[6:]} {value / total:.1%}" for value, name in by_reason if value > 0))
    hottest = sorted(range(len(body)), key=lambda k: -number(body[k][samples]))[:top]
    for k in sorted(hottest):
        row = body[k]
        main_reasons = sorted(((number(row[i]), header[i][6:]) for i in reasons), reverse=True)[:2]
        why = ", ".join(f"{name} {value:.0f}" for value, name in main_reasons if value > 0)
        ran = f"{number(row[executed]):>9.0f}" if executed is not None else ""
        print(f"{k:5d} {number(row[samples]) / total:6.1%} {ran} {row[source].strip()[:72]:72s} {why}")


if __name__ == "__main__":
    main()
