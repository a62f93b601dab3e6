"""Load through router -> prefill -> decode in separate processes (reliability.md, "Load held").

64 concurrent greedy streams over 8 distinct prompts with the AsyncOpenAI client; every token of every
stream is checked against the single-request reference (`deltaserve generate`), so a lost, duplicated
or rewritten token fails the test. A client that drops its connection after two chunks runs in the
middle of the load. Afterwards the cluster must be back at baseline: /ready, /metrics gauges (when the
endpoint exists) and a fresh request served quickly and exactly.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import requests

from conftest import PROMPTS, Cluster, http_get
from streamcheck import check_token_strings, collect_stream

STREAMS = 64
MAX_TOKENS = 32
WALL_LIMIT_S = 120.0


class _SyncIter:
    """Adapts a list of already-received chunks to collect_stream's iterator interface."""

    def __init__(self, chunks):
        self.chunks = chunks

    def __iter__(self):
        return iter(self.chunks)


def disconnect_after_chunks(cluster: Cluster, prompt: str, max_tokens: int, chunks: int = 2) -> int:
    """Opens a raw streaming request, reads `chunks` SSE events, then closes the connection abruptly.
    Returns the number of events read."""
    body = json.dumps({"model": cluster.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {cluster.host}:{cluster.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    s = socket.create_connection((cluster.host, cluster.port), timeout=30)
    try:
        s.sendall(head + body)
        data = b""
        while True:
            part = s.recv(4096)
            if not part:
                break
            data += part
            body = data.partition(b"\r\n\r\n")[2]
            if body.count(b"data: ") >= chunks and body.count(b"\n\n") >= chunks:
                break
        assert data.startswith(b"HTTP/1.1 200"), data[:300]
        return data.partition(b"\r\n\r\n")[2].count(b"data: ")
    finally:
        # RST rather than FIN: the harshest way a client can go away.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()


def metrics_snapshot(cluster: Cluster) -> dict[str, float] | None:
    """Gauges from /metrics that describe in-flight work (None when there is no /metrics)."""
    try:
        status, _, body = http_get(cluster.url + "/metrics", timeout=5)
    except OSError:
        return None
    if status != 200:
        return None
    out = {}
    for line in body.decode("utf-8", "replace").splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+([-+0-9.eEinfNa]+)$", line.strip())
        if m and re.search(r"running|waiting|active|in_flight|inflight|slots_used|used_slots|queue", m.group(1)):
            out[m.group(1)] = float(m.group(2))
    return out


def test_64_concurrent_streams(multi_cluster: Cluster, reference):
    c = multi_cluster
    refs = {p: reference.get(p, MAX_TOKENS, ignore_eos=True) for p in PROMPTS}
    for p, r in refs.items():
        assert len(r["tokens"]) == MAX_TOKENS
    baseline = metrics_snapshot(c)

    async def one(client, i: int):
        prompt = PROMPTS[i % len(PROMPTS)]
        t0 = time.monotonic()
        try:
            stream = await client.completions.create(model=c.model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, logprobs=1, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True})
            chunks = []
            first = None
            async for chunk in stream:
                if first is None:
                    first = time.monotonic() - t0
                chunks.append(chunk)
            res = collect_stream(_SyncIter(chunks), "completion", expected_text={0: refs[prompt]["text"]})
            ch = res.choices[0]
            assert ch.text == refs[prompt]["text"], f"stream {i}: text differs from the reference"
            check_token_strings(ch.token_strs, refs[prompt], f"stream {i}")
            assert len(ch.token_strs) == MAX_TOKENS == res.usage.completion_tokens, (
                f"stream {i}: {len(ch.token_strs)} tokens delivered, usage {res.usage.completion_tokens}")
            assert ch.finish_reason == "length"
            return {"ok": True, "tokens": len(ch.token_strs), "ttft": first, "e2e": time.monotonic() - t0}
        except Exception as e:  # noqa: BLE001
            return {"ok": False, "error": f"stream {i} ({prompt!r}): {type(e).__name__}: {e}"}

    disconnect_result: dict = {}

    def disconnector():
        try:
            disconnect_result["events"] = disconnect_after_chunks(c, PROMPTS[7], 20000)
        except Exception as e:  # noqa: BLE001
            disconnect_result["error"] = repr(e)

    async def main():
        client = c.async_client(timeout=WALL_LIMIT_S)
        tasks = [asyncio.create_task(one(client, i)) for i in range(STREAMS)]
        await asyncio.sleep(0.05)
        t = threading.Thread(target=disconnector)
        t.start()
        out = await asyncio.wait_for(asyncio.gather(*tasks), timeout=WALL_LIMIT_S)
        await asyncio.to_thread(t.join, 30)
        await client.close()
        return out

    t0 = time.monotonic()
    results = asyncio.run(main())
    wall = time.monotonic() - t0
    failures = [r["error"] for r in results if not r["ok"]]
    tokens = sum(r.get("tokens", 0) for r in results)
    ttfts = sorted(r["ttft"] for r in results if r["ok"] and r["ttft"] is not None)
    p50 = ttfts[len(ttfts) // 2] if ttfts else float("nan")
    p99 = ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] if ttfts else float("nan")
    print(f"\nload: {STREAMS} concurrent streams x {MAX_TOKENS} tokens through router -> prefill -> 2 decode: "
          f"{len(results) - len(failures)} ok, {len(failures)} failed, {tokens} tokens checked (0 lost, "
          f"0 duplicated unless failed), wall {wall:.2f} s, {tokens / wall:.0f} tokens/s, "
          f"TTFT p50 {p50 * 1e3:.0f} ms p99 {p99 * 1e3:.0f} ms; mid-stream disconnect: {disconnect_result}")
    assert not failures, f"{len(failures)} of {STREAMS} streams failed:\n" + "\n".join(failures[:10])
    assert tokens == STREAMS * MAX_TOKENS
    assert wall < WALL_LIMIT_S
    assert "error" not in disconnect_result, f"the disconnecting client failed: {disconnect_result}"
    c.check_alive()

    # Back to baseline: every decode state slot free and no request left anywhere (the /ready body
    # carries the router's counts and the workers' latest load reports, which arrive within ~0.5 s).
    deadline = time.monotonic() + 10
    while True:
        status, _, body = http_get(c.url + "/ready")
        assert status == 200, body
        ready = json.loads(body)
        idle = (ready["running"] == 0 and ready["waiting"] == 0 and ready["worker_requests"] == 0
                and ready["decode_slots_free"] == ready["decode_slots_total"] > 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    print(f"load: after the load /ready reports {ready}")
    assert idle, f"resources not back to baseline 10 s after the load: {ready}"
    deadline = time.monotonic() + 10
    after = metrics_snapshot(c)
    while after and baseline is not None and time.monotonic() < deadline and any(
            after.get(k, 0) != v for k, v in baseline.items()):
        time.sleep(0.2)
        after = metrics_snapshot(c)
    if baseline is None:
        print("load: no /metrics endpoint; baseline judged by /ready and a fresh request")
    else:
        print(f"load: /metrics in-flight gauges before {baseline} after {after}")
        for k, v in baseline.items():
            assert after.get(k) == v, f"{k} is {after.get(k)} after the load, {v} before"
    t1 = time.monotonic()
    ref = reference.get(PROMPTS[0], MAX_TOKENS, ignore_eos=True)
    resp = c.client().completions.create(model=c.model_id, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
    fresh = time.monotonic() - t1
    assert resp.choices[0].text == ref["text"]
    assert fresh < 5, f"a fresh request after the load took {fresh:.2f} s"
    print(f"load: fresh request after the load served in {fresh * 1e3:.0f} ms")


def test_disconnect_frees_decode_slots(make_cluster, reference):
    """Two decode workers with one state slot each. Two clients start very long streams (20k tokens,
    many seconds of decoding) and drop the connection after two chunks. If the abort reaches the
    decode workers, their slots free at once and new requests are served within seconds; if not, the
    new requests wait behind the abandoned generations."""
    c = make_cluster("multi", decode_flags=["--max-batch", "1"])
    for _ in range(2):
        assert disconnect_after_chunks(c, PROMPTS[7], 20000) >= 2
    t0 = time.monotonic()
    prompts = PROMPTS[:4]
    refs = {p: reference.get(p, 8, ignore_eos=True) for p in prompts}
    results = {}

    def run(p):
        try:
            r = requests.post(c.url + "/v1/completions", json={"model": c.model_id, "prompt": p, "max_tokens": 8,
                                                               "temperature": 0, "ignore_eos": True}, timeout=20)
            results[p] = (r.status_code, r.json())
        except Exception as e:  # noqa: BLE001
            results[p] = (None, repr(e))

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    took = time.monotonic() - t0
    print(f"\ndisconnect: 4 requests after 2 mid-stream disconnects (1 slot per decode worker) took {took:.2f} s")
    for p in prompts:
        status, body = results[p]
        assert status == 200, f"request after the disconnects: {status} {body}"
        assert body["choices"][0]["text"] == refs[p]["text"]
    assert took < 10, f"requests after the disconnects waited {took:.1f} s: the aborted streams kept their slots"
    c.check_alive()
    assert http_get(c.url + "/ready")[0] == 200
