"""A real Prometheus server (Debian's /usr/bin/prometheus) scrapes a real `deltaserve serve` every
second, with deltaserve's alert and recording rules loaded. After traffic, its HTTP API must report
what the clients saw: request count, generated tokens (sum of usage.completion_tokens) and cached
tokens (sum of usage.prompt_tokens_details.cached_tokens, with a repeated prompt so the prefix cache
has something to hit). Every dashboard query must also be valid PromQL for this server.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

import pytest
import requests

import ds_integration as ds
import opslib
from test_live_metrics import complete

DEADLINE_S = 60.0  # Prometheus syncs targets about 5 s after start; then 1 s scrapes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, target: str, workdir: str):
        binary = shutil.which("prometheus") or "/usr/bin/prometheus"
        assert os.path.exists(binary), "prometheus not found: install the Debian package (scripts/setup-debian.sh)"
        shutil.copy(opslib.RULES, os.path.join(workdir, "rules.yml"))
        config = os.path.join(workdir, "prometheus.yml")
        with open(config, "w", encoding="utf-8") as f:
            f.write(f"""global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: [rules.yml]
scrape_configs:
  - job_name: deltaserve
    static_configs:
      - targets: ['{target}']
""")
        check = subprocess.run([opslib.promtool(), "check", "config", config], capture_output=True, text=True,
                               timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(workdir, "prometheus.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir)

    def log_tail(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read()[-3000:].decode(errors="replace")

    def api(self, path: str, **params) -> dict:
        r = requests.get(self.url + "/api/v1/" + path, params=params, timeout=10)
        body = r.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def scalar(self, expr: str) -> float | None:
        result = self.api("query", query=expr)["result"]
        return float(result[0]["value"][1]) if result else None

    def wait(self, what: str, condition, deadline: float):
        last = None
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited ({self.proc.returncode})\n{self.log_tail()}"
            try:
                last = condition()
                if last:
                    return last
            except (requests.RequestException, AssertionError, ValueError) as e:
                last = repr(e)
            time.sleep(0.5)
        pytest.fail(f"prometheus: {what} not true within {DEADLINE_S} s (last: {last})\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


def test_prometheus_scrapes_what_clients_saw(ops_env, ops_logdir, ops_model_dir, tmp_path):
    cluster = ds.Cluster("serve", ops_env, ops_logdir, ops_model_dir, tag="-ops-prom")
    prom = None
    try:
        prom = Prometheus(f"{cluster.host}:{cluster.port}", str(tmp_path))
        deadline = time.monotonic() + DEADLINE_S
        prom.wait("target up", lambda: prom.scalar('up{job="deltaserve"}') == 1, deadline)

        # A long prompt (several 512-token blocks) sent twice, so a prefix cache can hit; then a mix.
        long_prompt = " ".join(ds.PROMPTS) * 40
        usages = []
        for prompt, stream in [(long_prompt, False), (long_prompt, True), *((p, i % 2 == 1)
                                                                           for i, p in enumerate(ds.PROMPTS[:4]))]:
            status, usage = complete(cluster.url, prompt, 8, stream=stream, model=cluster.model_id)
            assert status == 200 and usage, (status, usage)
            usages.append(usage)
        sent = len(usages)
        generated = sum(u["completion_tokens"] for u in usages)
        prompted = sum(u["prompt_tokens"] for u in usages)
        cached = sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usages)
        print(f"\nprometheus: {sent} requests, {prompted} prompt tokens ({cached} cached), {generated} generated")

        expected = {
            'sum(deltaserve_http_requests_total{endpoint="/v1/completions",code="200"})': sent,
            "sum(vllm:request_success_total)": sent,
            "sum(vllm:generation_tokens_total)": generated,
            "sum(vllm:prompt_tokens_total)": prompted,
            "sum(vllm:prefix_cache_hits_total)": cached,
            "sum(deltaserve_prefix_cache_hit_tokens_total)": cached,
            "sum(vllm:e2e_request_latency_seconds_count)": sent,
        }

        def all_match():
            got = {expr: prom.scalar(expr) for expr in expected}
            return got if all(got[e] == v for e, v in expected.items()) else None

        prom.wait(f"series equal to {expected}", all_match, time.monotonic() + DEADLINE_S)
        ttft_p99 = prom.scalar("histogram_quantile(0.99, sum by (le) (vllm:time_to_first_token_seconds_bucket))")
        assert ttft_p99 is not None and 0 < ttft_p99 < 60, ttft_p99
        assert prom.scalar("deltaserve_ready") == 1
        if cached > 0:  # the repeated long prompt was served from the cache, so the cache holds its blocks
            assert prom.scalar("sum(deltaserve_prefix_cache_entries)") > 0

        # The rules load and evaluate without error against real series.
        def rules_healthy():
            rules = [r for g in prom.api("rules")["groups"] for r in g["rules"]]
            bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
            return rules if rules and not bad else None

        rules = prom.wait("every rule evaluated with health ok", rules_healthy, time.monotonic() + DEADLINE_S)
        assert len(rules) == 15
        # No alert fires on a healthy, idle cluster.
        firing = [a for a in prom.api("alerts")["alerts"] if a["state"] == "firing"]
        assert not firing, firing

        # Every dashboard query is valid PromQL here (Grafana's variables given plain values).
        for where, expr in opslib.dashboard_queries():
            query = (expr.replace("$__rate_interval", "1m").replace('"$model_name"', '".*"')
                     .replace('"$instance"', '".*"'))
            prom.api("query", query=query)
    finally:
        if prom:
            prom.stop()
        problems = cluster.stop(check=False)
    assert not problems, "\n".join(problems)
