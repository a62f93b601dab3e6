#!/usr/bin/env python3
"""Shared-prefix workloads replayed through the cluster: prefix cache with cache-aware routing, with
load-only routing, and with the cache off, side by side in one run.

Workloads (token-id prompts, so equal blocks are exactly equal):
  * trace: the public Mooncake FAST'25 synthetic trace (shared/traces): its 512-token block hash ids are
    turned into token blocks (one deterministic block per id), so requests share prefixes exactly where
    the production-derived trace says they do. Sessions (requests whose first block is the same) are
    taken, most frequent first, until --trace-requests requests; prompts are capped at --trace-blocks
    blocks to fit a CPU run; trace order is kept.
  * chat: long system prompts shared by many conversations, each growing turn by turn (every turn
    repeats the whole conversation so far).
Each workload is sent by C closed-loop clients in order, streaming /v1/completions, greedy.

Figures per (workload, policy): TTFT p50/p99 (first SSE event carrying a token), prefill tokens computed
(prompt tokens minus usage.prompt_tokens_details.cached_tokens), cached fraction. The limit is the ideal
cache: for each request, the deepest block boundary (within its first N-1 tokens) that any earlier
request of the workload shares -- what a cache with unbounded memory and a checkpoint at every boundary,
on one worker, could serve. Peers: the same cluster with load-only routing, and with the cache off.

Stdlib only. Prints JSON lines (shared/spec/benchmarks.md format) on stdout.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import http.client
import json
import os
import platform
import queue
import random
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(os.path.dirname(REPO), "shared", "traces", "mooncake-fast25-synthetic.jsonl")
HTTP_RE = re.compile(r"deltaserve: http listening on http://([^\s:]+):(\d+)")
BLOCK = 512
VOCAB = 1000  # ordinary token ids of the tiny model


def block_tokens(key: int) -> list[int]:
    rng = random.Random(key * 1_000_003 + 17)
    return [rng.randrange(VOCAB) for _ in range(BLOCK)]


def trace_workload(requests: int, cap_blocks: int, path: str) -> list[list[int]]:
    rows = [json.loads(line) for line in open(path)]
    sessions = collections.Counter(r["hash_ids"][0] for r in rows)
    chosen, total = set(), 0
    for first, count in sessions.most_common():
        if total >= requests:
            break
        chosen.add(first)
        total += count
    prompts = []
    for r in rows:
        if r["hash_ids"][0] not in chosen:
            continue
        ids = r["hash_ids"][:cap_blocks]
        tokens = [t for h in ids for t in block_tokens(h)]
        if len(r["hash_ids"]) <= cap_blocks:
            tokens = tokens[: max(1, r["input_length"] - BLOCK * (len(r["hash_ids"]) - len(ids)))]
        prompts.append(tokens)
        if len(prompts) >= requests:
            break
    return prompts


def chat_workload(systems: int, conversations: int, turns: int) -> list[list[int]]:
    rng = random.Random(5)
    system = [[rng.randrange(VOCAB) for _ in range(4 * BLOCK)] for _ in range(systems)]
    history = [list(system[c % systems]) for c in range(conversations)]
    prompts = []
    for _ in range(turns):
        for c in range(conversations):
            history[c] += [rng.randrange(VOCAB) for _ in range(96)]  # the user's message
            prompts.append(list(history[c]))
            history[c] += [rng.randrange(VOCAB) for _ in range(48)]  # the assistant's answer
    return prompts


def ideal_cached(prompts: list[list[int]]) -> list[int]:
    seen: set[tuple] = set()
    out = []
    for p in prompts:
        usable = (len(p) - 1) // BLOCK
        depth = 0
        for k in range(1, usable + 1):
            if tuple(p[: k * BLOCK]) in seen:
                depth = k
            else:
                break
        out.append(depth * BLOCK)
        for k in range(1, len(p) // BLOCK + 1):
            seen.add(tuple(p[: k * BLOCK]))
    return out


class Server:
    def __init__(self, binary, model_dir, flags, env, log):
        self.p = subprocess.Popen([binary, "serve", "--model", model_dir, "--host", "127.0.0.1", "--port", "0",
                                   *flags], stdout=subprocess.PIPE, stderr=log, env=env, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        self.port = None
        while time.monotonic() < deadline:
            line = self.p.stdout.readline().decode("utf-8", "replace")
            if not line:
                raise RuntimeError("server exited during startup")
            m = HTTP_RE.search(line)
            if m:
                self.port = int(m.group(2))
                break
        threading.Thread(target=lambda: [None for _ in self.p.stdout], daemon=True).start()
        while time.monotonic() < deadline:
            try:
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                c.request("GET", "/ready")
                if c.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server not ready")

    def model(self) -> str:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        c.request("GET", "/v1/models")
        return json.loads(c.getresponse().read())["data"][0]["id"]

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()


def one_request(port: int, model: str, prompt: list[int], max_tokens: int) -> tuple[float, int, int]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
    ttft = None
    usage = None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if ttft is None and event.get("choices") and event["choices"][0].get("text") is not None:
            ttft = time.perf_counter() - start
        if event.get("usage"):
            usage = event["usage"]
    conn.close()
    details = usage.get("prompt_tokens_details") or {}
    return ttft, usage["prompt_tokens"], details.get("cached_tokens", 0)


def replay(port: int, model: str, prompts: list[list[int]], clients: int, max_tokens: int) -> dict:
    work: queue.Queue = queue.Queue()
    for i, p in enumerate(prompts):
        work.put((i, p))
    results: list = [None] * len(prompts)
    errors: list[str] = []

    def client():
        while True:
            try:
                i, p = work.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = one_request(port, model, p, max_tokens)
            except Exception as e:  # noqa: BLE001 -- reported below
                errors.append(f"request {i}: {e}")

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError("; ".join(errors[:5]))
    ttfts = sorted(r[0] for r in results)
    prompt_tokens = sum(r[1] for r in results)
    cached = sum(r[2] for r in results)
    return {"ttft_p50": statistics.median(ttfts), "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "prompt_tokens": prompt_tokens, "cached": cached, "computed": prompt_tokens - cached, "wall": wall}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(REPO, "build", "release", "cli", "deltaserve"))
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--trace-requests", type=int, default=120)
    ap.add_argument("--trace-blocks", type=int, default=8)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--prefill-workers", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--machine", default=f"cpu-{os.cpu_count()}core-{platform.machine()}")
    ap.add_argument("--command", default="bench/prefix_replay.sh")
    args = ap.parse_args()

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    common = {"machine": args.machine, "commit": commit, "date": datetime.date.today().isoformat(),
              "command": args.command}
    workloads = {
        f"trace(mooncake,{args.trace_requests}req,<= {args.trace_blocks} blocks)":
            trace_workload(args.trace_requests, args.trace_blocks, args.trace),
        "chat(4 system prompts x 2048 tok, 24 convs x 4 turns)": chat_workload(4, 24, 4),
    }
    policies = {
        "cache-aware": ["--routing-policy", "cache-aware"],
        "load-only": ["--routing-policy", "load"],
        "cache-off": ["--routing-policy", "load", "--prefix-cache", "false"],
    }
    with tempfile.TemporaryDirectory(prefix="ds-prefix-replay-") as tmp:
        env = dict(os.environ, DELTASERVE_HOME=tmp)
        model_dir = os.path.join(tmp, "model")
        subprocess.run([args.binary, "make-model", "--preset", "tiny-linear", "--out", model_dir], check=True,
                       env=env, capture_output=True)
        for wname, prompts in workloads.items():
            ideal = sum(ideal_cached(prompts))
            total = sum(len(p) for p in prompts)
            figures = {}
            for pname, flags in policies.items():
                log = open(os.path.join(tmp, f"{pname}.stderr"), "wb")
                server = Server(args.binary, model_dir,
                                [*flags, "--prefill-workers", str(args.prefill_workers), "--decode-workers", "1",
                                 "--index-dir", os.path.join(tmp, f"index-{pname}-{len(figures)}")], env, log)
                try:
                    figures[pname] = replay(server.port, server.model(), prompts, args.clients, args.max_tokens)
                finally:
                    server.stop()
            case = f"{wname},{len(prompts)} requests,{total} prompt tokens,{args.prefill_workers} prefill workers"
            for pname, f in figures.items():
                off, load = figures["cache-off"], figures["load-only"]
                rows = [
                    ("cached_tokens_fraction", round(f["cached"] / total, 4), "fraction",
                     round(ideal / total, 4), round(f["cached"] / ideal, 4) if ideal else None, None, None),
                    ("prefill_tokens_computed", f["computed"], "tokens", total - ideal,
                     round((total - ideal) / f["computed"], 4) if f["computed"] else None,
                     off["computed"], round(f["computed"] / off["computed"], 4)),
                    ("ttft_p50", round(f["ttft_p50"] * 1e3, 2), "ms", None, None, round(off["ttft_p50"] * 1e3, 2),
                     round(f["ttft_p50"] / off["ttft_p50"], 4)),
                    ("ttft_p99", round(f["ttft_p99"] * 1e3, 2), "ms", None, None, round(off["ttft_p99"] * 1e3, 2),
                     round(f["ttft_p99"] / off["ttft_p99"], 4)),
                    ("wall_time", round(f["wall"], 2), "s", None, None, round(load["wall"], 2),
                     round(f["wall"] / load["wall"], 4)),
                ]
                for metric, value, unit, limit, ratio_limit, peer_value, ratio_peer in rows:
                    peer = None if peer_value is None else ("load-only routing" if metric == "wall_time" else "cache off")
                    print(json.dumps({"bench": "prefix_replay", "case": f"{case},policy={pname}", "metric": metric,
                                      "value": value, "unit": unit, "limit": limit, "ratio_to_limit": ratio_limit,
                                      "peer": peer, "peer_value": peer_value, "ratio_to_peer": ratio_peer,
                                      **common}), flush=True)


if __name__ == "__main__":
    main()
