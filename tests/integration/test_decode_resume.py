"""A decode worker killed mid-stream (reliability.md, "Faults survived"): the router resumes the request on
another decode worker from the prompt plus the tokens already streamed, and the client's stream is the one an
uninterrupted request gives: no error event, no token lost, repeated or rewritten, the same usage. Greedy and
seeded sampling (the resumed sampler continues the seeded stream at the next draw).

The fault is placed by token count, not by time: the client reads 5 chunks, then the decode process that holds
the request (the one whose /metrics reports an active request) is SIGKILLed. Whatever it generated beyond those
5 chunks and had not yet delivered is regenerated; what it had delivered is checked, not repeated.
"""

from __future__ import annotations

import json
import re
import time

import requests

from conftest import PROMPTS, http_get

MAX_TOKENS = 1500  # long enough that the stream is still running when the fault lands
KILL_AFTER_CHUNKS = 5
METRICS_RE = re.compile(r"deltaserve: metrics listening on (http://\S+/metrics)")
ACTIVE_RE = re.compile(r'^deltaserve_worker_requests\{[^}]*state="active"[^}]*\} (\S+)$', re.MULTILINE)


def decode_holding_a_request(c, metrics_urls):
    """The decode process whose workers report an active request (scraped now, not from a heartbeat)."""
    for proc, url in metrics_urls.items():
        if not proc.alive():
            continue
        status, _, body = http_get(url)
        if status != 200:
            continue
        m = ACTIVE_RE.search(body.decode())
        if m and float(m.group(1)) > 0:
            return proc
    return None


def stream_with_fault(c, body, metrics_urls):
    """Streams `body`; after KILL_AFTER_CHUNKS chunks SIGKILLs the decode process holding the request.
    Returns (text, finish_reason, usage, the killed process)."""
    text, finish, usage, killed, chunks = "", None, None, None, 0
    with requests.post(c.url + "/v1/completions", json={**body, "stream": True,
                                                       "stream_options": {"include_usage": True}},
                       stream=True, timeout=120) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                break
            event = json.loads(data)
            assert "error" not in event, f"error event after {chunks} chunks: {event}"
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                assert finish is None, "a chunk after the finish_reason"
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
                chunks += 1
            if killed is None and chunks == KILL_AFTER_CHUNKS:
                killed = decode_holding_a_request(c, metrics_urls)
                assert killed is not None, "no decode process reports the request as active"
                killed.proc.kill()
    return text, finish, usage, killed


def test_decode_worker_killed_mid_stream_resumes_elsewhere(make_cluster):
    c = make_cluster("multi", decode_workers=3, decode_flags=["--metrics-listen", "127.0.0.1:0"])
    decoders = [p for p in c.procs if "decode" in p.name]
    metrics_urls = {}
    for p in decoders:
        m = p.wait_line(METRICS_RE, time.monotonic() + 60)[0]
        metrics_urls[p] = m.group(1)
    killed_total = 0
    for params in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 1234}):
        body = {"model": c.model_id, "prompt": PROMPTS[6], "max_tokens": MAX_TOKENS, "ignore_eos": True, **params}
        r = requests.post(c.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        want = r.json()
        text, finish, usage, killed = stream_with_fault(c, body, metrics_urls)
        killed_total += 1
        assert killed is not None
        assert text == want["choices"][0]["text"], f"{params}: the resumed stream differs from the uninterrupted one"
        assert finish == want["choices"][0]["finish_reason"] == "length"
        assert usage is not None
        assert usage["prompt_tokens"] == want["usage"]["prompt_tokens"]
        assert usage["completion_tokens"] == want["usage"]["completion_tokens"] == MAX_TOKENS
        print(f"\nresume ({params}): decode worker {killed.name} SIGKILLed after {KILL_AFTER_CHUNKS} chunks; "
              f"{MAX_TOKENS} tokens equal to the uninterrupted completion")
    retries = c.front.stderr_tail(200000).count("failed, prefilling again")
    assert retries == killed_total, f"expected {killed_total} retries in the router's log, saw {retries}"
    assert http_get(c.url + "/ready")[0] == 200
