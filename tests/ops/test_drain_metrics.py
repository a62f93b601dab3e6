"""What the manifests rely on, seen through /metrics and the probes: a client that leaves mid-stream is
counted as an abort; on SIGTERM the front reports draining, /ready turns 503 while /health stays 200,
the stream in flight still finishes, and the process exits 0.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import requests

import ds_integration as ds
import opslib
from test_live_metrics import scrape

LONG = 8000  # tokens (two seconds or more on the tiny model): the stream is still running while the test acts


def start_stream(url: str, model: str, max_tokens: int) -> requests.Response:
    body = {"model": model, "prompt": ds.PROMPTS[0], "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True}
    r = requests.post(url + "/v1/completions", json=body, stream=True, timeout=120)
    assert r.status_code == 200
    return r


def wait_for(condition, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = condition()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_abort_then_drain(ops_env, ops_logdir, ops_model_dir):
    c = ds.Cluster("serve", ops_env, ops_logdir, ops_model_dir, tag="-ops-drain")
    try:
        # A client that leaves after the first event: one `abort`, and the slot comes back.
        r = start_stream(c.url, c.model_id, LONG)
        first = next(line for line in r.iter_lines() if line.startswith(b"data: "))
        assert json.loads(first[6:])["choices"]
        r.close()
        _, s = wait_for(lambda: (lambda t: t if opslib.value(t[1], "vllm:request_success_total",
                                                             finished_reason="abort") == 1 else None)(
            scrape(c.url + "/metrics")), "abort counted")
        assert opslib.value(s, "vllm:request_success_total", finished_reason="length") == 0
        assert opslib.value(s, "deltaserve_http_requests_total", endpoint="/v1/completions", code="200") == 1
        wait_for(lambda: opslib.value(scrape(c.url + "/metrics")[1], "deltaserve_kda_state_slots", state="used") == 0,
                 "the aborted request's state slot freed")

        # SIGTERM with a stream in flight.
        r = start_stream(c.url, c.model_id, LONG)
        lines = r.iter_lines()
        next(line for line in lines if line.startswith(b"data: "))
        rest: list[bytes] = []
        reader = threading.Thread(target=lambda: rest.extend(lines), daemon=True)
        reader.start()
        c.front.signal(signal.SIGTERM)
        wait_for(lambda: requests.get(c.url + "/ready", timeout=5).status_code == 503, "/ready 503 after SIGTERM")
        _, s = scrape(c.url + "/metrics")
        assert opslib.value(s, "deltaserve_draining") == 1 and opslib.value(s, "deltaserve_ready") == 0
        assert b"data: [DONE]" not in rest, "the stream ended before the drain was observed: make LONG longer"
        assert requests.get(c.url + "/health", timeout=5).status_code == 200  # liveness holds while draining
        refused = requests.post(c.url + "/v1/completions", timeout=10,
                                json={"model": c.model_id, "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers.get("Retry-After"), refused.status_code
        reader.join(timeout=120)
        events = [line for line in rest if line]
        assert events and events[-1] == b"data: [DONE]", events[-3:]  # the in-flight stream finished
        assert c.front.wait(60) == 0, f"serve exited {c.front.proc.returncode} after SIGTERM"
    finally:
        problems = c.stop(check=False)
    assert not problems, "\n".join(problems)
