#!/usr/bin/env python3
"""Router-added latency and requests/s through the HTTP front, with the tiny model on the CPU.

For each topology -- `serve` (all roles in one process) and `multi` (router + 1 prefill + 2 decode
processes on loopback) -- the script measures:
  * TTFT as the client sees it: a streaming /v1/completions request (max_tokens 1, greedy) on a kept-
    alive connection, from the first byte sent to the first SSE event that carries the token;
  * the engine's own time to the first token for the same prompt: `deltaserve generate` reports its
    prefill time (prompt[0, N-1) plus the forward pass of the last prompt token, i.e. up to the first
    logits) on stderr; the median over several runs, same thread count as the servers;
  * router-added latency = client TTFT - engine time, p50 and p99 over many sequential requests;
  * requests/s: C client threads, each on its own connection, non-streaming requests of max_tokens 1
    for a fixed duration.

Prints JSON lines in the format of shared/spec/benchmarks.md (one per figure) on stdout; the shell
wrapper (bench/router_latency.sh) appends them to bench/results/router_latency.jsonl.

`limit`, `ratio_to_limit`, `peer`, `peer_value` and `ratio_to_peer` are null: router-added latency is
protocol, scheduling and actor-messaging overhead with no physical floor other than zero (a loopback
round trip is a few microseconds, far below what an HTTP + actor path can reach), and no peer serving
stack runs this model format on the CPU in the same invocation (vLLM/SGLang need a GPU and HF weights).

Stdlib only (no venv needed). Usage: bench/router_latency.py [--requests 300] [--duration 5]
[--concurrency 8] [--binary PATH] [--machine NAME] [--command TEXT]
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HTTP_RE = re.compile(r"deltaserve: http listening on http://([^\s:]+):(\d+)")
CLUSTER_RE = re.compile(r"deltaserve: cluster listening on ([^\s:]+):(\d+)")
PROMPT = "The quick brown fox jumps over the lazy dog."


class Proc:
    def __init__(self, args, env, log):
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, env=env, stdin=subprocess.DEVNULL)
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for raw in self.p.stdout:
            with self.cond:
                self.lines.append(raw.decode("utf-8", "replace"))
                self.cond.notify_all()

    def wait_line(self, pattern, timeout=60.0):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for line in self.lines:
                    m = pattern.search(line)
                    if m:
                        return m
                if self.p.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"no {pattern.pattern!r} from {self.p.args} (exit {self.p.poll()})")
                self.cond.wait(0.2)

    def stop(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        return self.p.returncode


def start(topology, binary, model, env, logdir):
    procs = []
    log = open(os.path.join(logdir, f"{topology}.log"), "ab")
    try:
        if topology == "serve":
            front = Proc([binary, "serve", "--model", model, "--host", "127.0.0.1", "--port", "0"], env, log)
            procs.append(front)
        else:
            front = Proc([binary, "router", "--model", model, "--host", "127.0.0.1", "--port", "0",
                          "--cluster-host", "127.0.0.1", "--cluster-port", "0"], env, log)
            procs.append(front)
            m = front.wait_line(CLUSTER_RE)
            join = f"{m.group(1)}:{m.group(2)}"
            procs.append(Proc([binary, "prefill", "--model", model, "--join", join], env, log))
            for _ in range(2):
                procs.append(Proc([binary, "decode", "--model", model, "--join", join], env, log))
        m = front.wait_line(HTTP_RE)
        host, port = m.group(1), int(m.group(2))
        deadline = time.monotonic() + 60
        while True:
            try:
                c = http.client.HTTPConnection(host, port, timeout=2)
                c.request("GET", "/ready")
                if c.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{topology}: /ready not 200 within 60 s")
            time.sleep(0.1)
        c = http.client.HTTPConnection(host, port, timeout=10)
        c.request("GET", "/v1/models")
        model_id = json.loads(c.getresponse().read())["data"][0]["id"]
        return procs, host, port, model_id
    except BaseException:
        for p in procs:
            p.stop()
        raise


def stream_ttft(conn, model_id):
    body = json.dumps({"model": model_id, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "stream": True,
                       "ignore_eos": True})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"status {resp.status}: {resp.read()[:300]!r}")
    ttft = None
    buf = b""
    while True:
        line = resp.readline()
        if not line:
            break
        buf += line
        if line.startswith(b"data: ") and ttft is None and b'"text"' in line and line.strip() != b"data: [DONE]":
            ttft = time.perf_counter() - t0
        if line.strip() == b"data: [DONE]":
            break
    resp.read()
    return ttft, time.perf_counter() - t0


def engine_ttft(binary, model, env, runs):
    times, prompt_tokens = [], None
    for _ in range(runs):
        out = subprocess.run([binary, "generate", "--model", model, "--prompt", PROMPT, "--max-tokens", "1",
                              "--ignore-eos"], capture_output=True, text=True, env=env, check=True)
        m = re.search(r"prompt (\d+) tokens, prefill (\d+) tok/s", out.stderr)
        prompt_tokens = int(m.group(1))
        times.append(prompt_tokens / max(int(m.group(2)), 1))
    return statistics.median(times), prompt_tokens


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def rps(host, port, model_id, concurrency, duration):
    stop_at = time.monotonic() + duration
    counts, errors = [0] * concurrency, [0] * concurrency
    body = json.dumps({"model": model_id, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True})

    def worker(i):
        conn = http.client.HTTPConnection(host, port, timeout=5)
        while time.monotonic() < stop_at:
            try:
                conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                if r.status == 200:
                    counts[i] += 1
                else:
                    errors[i] += 1
            except OSError:
                errors[i] += 1
                conn = http.client.HTTPConnection(host, port, timeout=5)

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - t0), sum(errors)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=os.environ.get("DELTASERVE_BINARY",
                                                       os.path.join(REPO, "build/release/cli/deltaserve")))
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--engine-runs", type=int, default=15)
    ap.add_argument("--threads", default=os.environ.get("DELTASERVE_THREADS", "1"))
    ap.add_argument("--machine", default=os.environ.get("DELTASERVE_MACHINE",
                                                        f"cpu-{os.cpu_count()}core-{platform.machine()}"))
    ap.add_argument("--command", default="bench/router_latency.sh")
    ap.add_argument("--topologies", default="serve,multi")
    args = ap.parse_args()

    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    date = datetime.date.today().isoformat()
    work = tempfile.mkdtemp(prefix="deltaserve-bench-")
    env = dict(os.environ, DELTASERVE_HOME=os.path.join(work, "home"), DELTASERVE_THREADS=str(args.threads))
    model = os.path.join(work, "model")
    subprocess.run([args.binary, "make-model", "--preset", "tiny-linear", "--out", model], check=True,
                   capture_output=True, env=env)
    engine_s, prompt_tokens = engine_ttft(args.binary, model, env, args.engine_runs)
    print(f"# engine time to first token (generate, {prompt_tokens}-token prompt, median of {args.engine_runs}): "
          f"{engine_s * 1e3:.3f} ms", file=sys.stderr)

    def line(case, metric, value, unit):
        return json.dumps({"bench": "router_latency", "case": case, "metric": metric, "value": round(value, 4),
                           "unit": unit, "limit": None, "ratio_to_limit": None, "peer": None, "peer_value": None,
                           "ratio_to_peer": None, "machine": args.machine, "commit": commit, "date": date,
                           "command": args.command})

    out = []
    p50s = {}
    for topology in args.topologies.split(","):
        procs, host, port, model_id = start(topology, args.binary, model, env, work)
        try:
            conn = http.client.HTTPConnection(host, port, timeout=5)
            ttfts, hung = [], 0
            for i in range(args.warmup + args.requests):
                try:
                    t, _ = stream_ttft(conn, model_id)
                except (OSError, http.client.HTTPException):
                    # A request that got no answer within 5 s (counted and reported, not timed).
                    hung += 1
                    conn = http.client.HTTPConnection(host, port, timeout=5)
                    continue
                if i >= args.warmup:
                    ttfts.append(t)
            added = [t - engine_s for t in ttfts]
            case = f"topology={topology},prompt_tokens={prompt_tokens},max_tokens=1,threads={args.threads}"
            p50s[topology] = pct(added, 0.5)
            out.append(line(case, "ttft_p50", pct(ttfts, 0.5) * 1e3, "ms"))
            out.append(line(case, "router_added_ttft_p50", pct(added, 0.5) * 1e3, "ms"))
            out.append(line(case, "router_added_ttft_p99", pct(added, 0.99) * 1e3, "ms"))
            out.append(line(case, "engine_ttft", engine_s * 1e3, "ms"))
            rate, errors = rps(host, port, model_id, args.concurrency, args.duration)
            out.append(line(f"topology={topology},concurrency={args.concurrency},max_tokens=1,threads={args.threads}",
                            "throughput", rate, "requests/s"))
            print(f"# {topology}: TTFT p50 {pct(ttfts, 0.5) * 1e3:.2f} ms, router-added p50 "
                  f"{pct(added, 0.5) * 1e3:.2f} ms p99 {pct(added, 0.99) * 1e3:.2f} ms; {rate:.0f} requests/s "
                  f"({errors} errors); {hung} streaming requests unanswered within 5 s", file=sys.stderr)
        finally:
            for p in procs:
                p.stop()
    if "serve" in p50s and "multi" in p50s:
        # What the extra process hops (router -> prefill -> decode over CAF on loopback) add.
        out.append(line(f"multi_minus_serve,prompt_tokens={prompt_tokens},max_tokens=1,threads={args.threads}",
                        "router_added_ttft_p50", (p50s["multi"] - p50s["serve"]) * 1e3, "ms"))
    for o in out:
        print(o)


if __name__ == "__main__":
    main()
