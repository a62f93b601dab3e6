"""Routers that crash, with the real binary over mutual TLS: one prefill and one decode worker joined to two
routers (`--join A,B`) serve through both, the handoff going over the workers' own direct connection; SIGKILL of
one router leaves the other serving; with both gone the workers' /health turns 503 after --orphan-timeout-ms; a
router started again on the first one's cluster port gets the workers back (through their TLS tunnels), serves,
and their /health is 200 again.

Every wait is on an observable state (a line, /ready, /health) with a generous deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request

from conftest import CLUSTER_RE, DECODE_JOINED_RE, HTTP_RE, PREFILL_JOINED_RE, DsProcess, http_get, require_multi, \
    wait_ready
from test_cluster_tls import make_tls_secret

METRICS_RE = re.compile(r"deltaserve: metrics listening on http://([^\s:]+):(\d+)/metrics")
DEADLINE_S = 90.0


def start_router(name: str, cluster_port: int, tls: list[str], model: list[str], env, logdir) -> tuple[DsProcess, str,
                                                                                                      int]:
    proc = DsProcess(name, ["router", *model, "--port", "0", "--cluster-port", str(cluster_port), *tls], env, logdir)
    deadline = time.monotonic() + DEADLINE_S
    m = proc.wait_line(HTTP_RE, deadline)[0]
    c = proc.wait_line(CLUSTER_RE, deadline)[0]
    return proc, f"http://{m.group(1)}:{m.group(2)}", int(c.group(2))


def complete(url: str, prompt: str) -> dict:
    status, _, models = http_get(url + "/v1/models")
    assert status == 200, models
    model = json.loads(models)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def wait_health(url: str, want: int, procs: list[DsProcess]) -> bytes:
    deadline = time.monotonic() + DEADLINE_S
    last = None
    while time.monotonic() < deadline:
        status, _, body = http_get(url + "/health", timeout=10)
        if status == want:
            return body
        last = (status, body)
        time.sleep(0.1)
    raise AssertionError(f"{url}/health never {want} (last {last})\n" + "\n".join(p.describe() for p in procs))


# The prefill -> decode handoff goes over the workers' own direct connection (the decode worker's peer address,
# through its TLS tunnel), so it does not depend on the router that introduced the two workers.
def test_workers_outlive_their_routers(ds_env, logdir, model_dir, tmp_path):
    require_multi()
    root = str(tmp_path / "tls")
    os.makedirs(root)
    tls = ["--cluster-tls-dir", make_tls_secret(root, "cluster")]
    model = ["--model", model_dir]
    procs: list[DsProcess] = []
    try:
        router_a, url_a, port_a = start_router("router-a", 0, tls, model, ds_env, logdir)
        router_b, url_b, port_b = start_router("router-b", 0, tls, model, ds_env, logdir)
        procs += [router_a, router_b]
        join = ["--join", f"127.0.0.1:{port_a},127.0.0.1:{port_b}", "--orphan-timeout-ms", "1000"]
        workers = {}
        for role, joined in (("prefill", PREFILL_JOINED_RE), ("decode", DECODE_JOINED_RE)):
            p = DsProcess(f"recovery-{role}", [role, *model, *join, *tls, "--metrics-listen", "127.0.0.1:0"], ds_env,
                          logdir)
            procs.append(p)
            deadline = time.monotonic() + DEADLINE_S
            p.wait_line(joined, deadline)
            m = p.wait_line(METRICS_RE, deadline)[0]
            workers[role] = (p, f"http://{m.group(1)}:{m.group(2)}")
        for url in (url_a, url_b):  # each router has both workers (the second may join in the background)
            wait_ready(url, time.monotonic() + DEADLINE_S, procs)
        first = complete(url_a, "Hello world")
        assert complete(url_b, "Hello world")["choices"][0]["text"] == first["choices"][0]["text"]
        for _, url in workers.values():
            assert wait_health(url, 200, procs) == b"ok\n"

        # One router crashes: the other keeps serving.
        router_a.signal(signal.SIGKILL)
        router_a.wait(30)
        assert complete(url_b, "Hello world")["choices"][0]["text"] == first["choices"][0]["text"]

        # Both gone: the workers are orphans; after the bound their liveness fails.
        router_b.signal(signal.SIGKILL)
        router_b.wait(30)
        for _, url in workers.values():
            assert b"joined to no router" in wait_health(url, 503, procs)

        # A router on the first one's cluster port: the workers join it again (TLS) and it serves.
        router_c, url_c, port_c = start_router("router-c", port_a, tls, model, ds_env, logdir)
        procs.append(router_c)
        assert port_c == port_a
        live = [p for p in procs if p not in (router_a, router_b)]  # wait_ready fails on any dead process
        wait_ready(url_c, time.monotonic() + DEADLINE_S, live)
        assert complete(url_c, "Hello world")["choices"][0]["text"] == first["choices"][0]["text"]
        for _, url in workers.values():
            wait_health(url, 200, live)
        for p, _ in workers.values():
            assert p.alive(), p.describe()
    finally:
        for p in reversed(procs):
            p.stop()
