#!/usr/bin/env bash
# Transfer-layer bandwidth and latency on loopback (bench/ucx_transfer_bench: model-shaped payloads,
# two processes) side by side with ucx_perftest (Debian ucx-utils) on the same UCX_TLS and message
# sizes, interleaved round by round so both see the same machine noise; appends JSON lines to
# bench/results/ucx_transfer.jsonl (date, commit, machine, command).
#
#   bench/ucx_transfer.sh [UCX_TLS]          default posix,self (same host); e.g. "tcp,self" (+ lo)
# Environment: DELTASERVE_BUILD_DIR (default build/release, configured by the release preset),
# DELTASERVE_MACHINE (machine label), DELTASERVE_ROUNDS (default 3), DELTASERVE_SKIP_BUILD=1,
# DELTASERVE_COMMIT (commit label where the tree has no .git), DELTASERVE_CASES (comma-separated subset).
set -euo pipefail
cd "$(dirname "$0")/.."
tls=${1:-posix,self}
build=${DELTASERVE_BUILD_DIR:-build/release}
if [[ -z ${DELTASERVE_SKIP_BUILD:-} ]]; then
  if [[ $build == build/release ]]; then cmake --preset release >/dev/null; fi
  cmake --build "$build" --target ucx_transfer_bench -j "${DELTASERVE_JOBS:-1}" >/dev/null
fi
machine=${DELTASERVE_MACHINE:-"cpu-$(nproc)core-$(uname -m)"}
command -v ucx_perftest >/dev/null || { echo "ucx_perftest not found (apt-get install ucx-utils)" >&2; exit 1; }
python3 - "$build/bench/ucx_transfer_bench" "$tls" "$machine" "${DELTASERVE_COMMIT:-$(git rev-parse --short HEAD)}" \
  "${DELTASERVE_ROUNDS:-3}" <<'PY' | tee -a bench/results/ucx_transfer.jsonl
import datetime, json, os, socket, statistics, subprocess, sys, time

bench, tls, machine, commit, rounds = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
env = dict(os.environ, UCX_TLS=tls)
extra = []
if "tcp" in tls:
    env["UCX_NET_DEVICES"] = "lo"
    extra = ["--net-devices", "lo"]
env.pop("UCX_WARN_UNUSED_ENV_VARS", None)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def perftest(test, size, iters, warmup):
    """One ucx_perftest server+client pair on loopback; returns (overall latency us, overall MiB/s)."""
    for _ in range(5):
        port = str(free_port())
        server = subprocess.Popen(["ucx_perftest", "-p", port], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        time.sleep(0.3)
        try:
            out = subprocess.run(["ucx_perftest", "127.0.0.1", "-p", port, "-t", test, "-s", str(size), "-n",
                                  str(iters), "-w", str(warmup), "-v"], env=env, capture_output=True, text=True,
                                 timeout=300)
        finally:
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        lines = [l for l in out.stdout.splitlines() if l.strip() and l.strip()[0].isdigit()]
        if out.returncode == 0 and lines:
            f = lines[-1].split(",")
            return float(f[3]), float(f[5])
    raise SystemExit(f"ucx_perftest {test} -s {size} failed: {out.stdout[-500:]} {out.stderr[-500:]}")


def ours(case, flags, iters, warmup):
    args = [bench, "--tls", tls, "--cases", case, "--iters", str(iters), "--warmup", str(warmup)] + extra + flags
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, check=True)
    rows = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    return next(r for r in rows if r["kind"] == "transfer"), next(r for r in rows if r["kind"] == "checksum")


common = {"machine": machine, "commit": commit, "date": datetime.date.today().isoformat(),
          "command": f"bench/ucx_transfer.sh {tls}"}
cases = ["kda_state_tiny_linear", "kda_state_48b", "mla_pages_48b_4k", "mla_pages_48b_32k", "mla_pages_48b_128k"]
if os.environ.get("DELTASERVE_CASES"):
    cases = [c for c in cases if c in os.environ["DELTASERVE_CASES"].split(",")]
checksum_gbps, memcpy_gbps = [], []
for case in cases:
    big = case == "mla_pages_48b_128k"
    iters, warmup = (3, 1) if big else (7, 2)
    samples = {"send": [], "presum": [], "put": [], "peer_bw": [], "peer_lat": []}
    row = None
    for _ in range(rounds):
        row, cs = ours(case, [], iters, warmup)
        samples["send"].append(row["median_s"])
        checksum_gbps.append(cs["checksum_gbps"])
        memcpy_gbps.append(cs["memcpy_gbps"])
        samples["presum"].append(ours(case, ["--presum"], iters, warmup)[0]["median_s"])
        samples["put"].append(ours(case, ["--put"], iters, warmup)[0]["median_s"])
        lat_us, mibps = perftest("ucp_put_bw", row["bytes"], iters * 4 if not big else iters, warmup)
        samples["peer_bw"].append(mibps * 1048576 / 1e9)
        if row["bytes"] < (1 << 20):
            samples["peer_lat"].append(perftest("ucp_put_lat", row["bytes"], 2000, 200)[0])
    nbytes = row["bytes"]
    peer_bw = statistics.median(samples["peer_bw"])
    shape = f"{nbytes} B, {row['pieces']} pieces, {row['segments']} segments, TLS={tls}"
    for mode, label in (("send", "default: direct copy + checksum in one pass"),
                        ("presum", "direct copy, precomputed checksums"),
                        ("put", "ucp_put_nbx + flush per piece, checksum on send")):
        t = statistics.median(samples[mode])
        bw = nbytes / t / 1e9
        print(json.dumps({"bench": "ucx_transfer", "case": f"{case} ({shape}, {label})", "metric": "bandwidth",
                          "value": round(bw, 3), "unit": "GB/s", "limit": None, "ratio_to_limit": None,
                          "peer": "ucx_perftest 1.13.1 ucp_put_bw (one put of the same bytes)",
                          "peer_value": round(peer_bw, 3), "ratio_to_peer": round(bw / peer_bw, 3), **common}))
        if mode == "send" and samples["peer_lat"]:
            peer_lat = statistics.median(samples["peer_lat"])
            print(json.dumps({"bench": "ucx_transfer", "case": f"{case} ({shape}, {label})", "metric": "latency",
                              "value": round(t * 1e6, 1), "unit": "us", "limit": None, "ratio_to_limit": None,
                              "peer": "ucx_perftest 1.13.1 ucp_put_lat (one-way put latency, same bytes)",
                              "peer_value": round(peer_lat, 1), "ratio_to_peer": round(peer_lat / (t * 1e6), 3),
                              **common}))
# Why puts and not active messages: the AM path's bandwidth on the same transport and size.
am_lat, am_mibps = perftest("ucp_am_bw", 40 << 20, 20, 3)
put_lat, put_mibps = perftest("ucp_put_bw", 40 << 20, 20, 3)
print(json.dumps({"bench": "ucx_am_vs_put", "case": f"40 MiB, TLS={tls}", "metric": "bandwidth",
                  "value": round(am_mibps * 1048576 / 1e9, 3), "unit": "GB/s", "limit": None, "ratio_to_limit": None,
                  "peer": "ucx_perftest 1.13.1 ucp_put_bw", "peer_value": round(put_mibps * 1048576 / 1e9, 3),
                  "ratio_to_peer": round(am_mibps / put_mibps, 3), **common}))
print(json.dumps({"bench": "checksum64", "case": "64 MiB, one core", "metric": "throughput",
                  "value": round(statistics.median(checksum_gbps), 2), "unit": "GB/s",
                  "limit": round(statistics.median(memcpy_gbps), 2), "ratio_to_limit":
                  round(statistics.median(checksum_gbps) / statistics.median(memcpy_gbps), 3),
                  "peer": None, "peer_value": None, "ratio_to_peer": None, **common}))
PY
