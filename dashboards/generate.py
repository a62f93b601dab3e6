#!/usr/bin/env python3
"""Writes the Grafana dashboards of deltaserve (dashboards/*.json) from the panel lists below.

    python3 dashboards/generate.py          # rewrite the JSON files
    python3 dashboards/generate.py --check  # exit 1 if a committed file differs from what this writes

Every dashboard takes its Prometheus data source as the variable `datasource` (pick it at import), and
filters by `model_name` (vLLM-compatible series) and `instance` (one replica) where that makes sense.
The metric names are deltaserve's (README "Operations"); tests/ops checks that each one exists in a
live scrape, or is declared by telemetry/ and waiting for the actors to fill it.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
MODEL = 'model_name=~"$model_name"'
INST = 'instance=~"$instance"'


def quantiles(metric: str, selector: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le{', ' + by if by else ''}"
    legend = f"{{{{{by}}}}} " if by else ""
    return [(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
             f"{legend}p{int(q * 100)}") for q in (0.5, 0.99)]


class Dashboard:
    def __init__(self, uid: str, title: str, description: str, variables: list[dict]):
        self.uid = uid
        self.title = title
        self.description = description
        self.variables = variables
        self.panels: list[dict] = []
        self._y = 0
        self._x = 0

    def row(self, title: str) -> None:
        if self._x:
            self._y += 8
            self._x = 0
        self.panels.append({"type": "row", "title": title, "collapsed": False, "id": len(self.panels) + 1,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self._y}, "panels": []})
        self._y += 1

    def panel(self, title: str, targets: list[tuple[str, str]], unit: str = "short", kind: str = "timeseries",
              width: int = 8, description: str = "") -> None:
        if self._x + width > 24:
            self._y += 8
            self._x = 0
        panel = {
            "id": len(self.panels) + 1,
            "type": kind,
            "title": title,
            "description": description,
            "datasource": DS,
            "gridPos": {"h": 8, "w": width, "x": self._x, "y": self._y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
            if kind == "timeseries" else {"reduceOptions": {"calcs": ["lastNotNull"]}},
            "targets": [{"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
                        for i, (expr, legend) in enumerate(targets)],
        }
        self.panels.append(panel)
        self._x += width

    def json(self) -> dict:
        templating = [{
            "name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
            "current": {}, "hide": 0, "refresh": 1, "options": [],
        }]
        for v in self.variables:
            templating.append({
                "name": v["name"], "label": v["label"], "type": "query", "datasource": DS,
                "query": {"query": v["query"], "refId": "vars"}, "definition": v["query"], "refresh": 2,
                "includeAll": True, "multi": True, "allValue": ".*", "current": {}, "options": [], "hide": 0,
                "sort": 1,
            })
        return {
            "uid": self.uid, "title": self.title, "description": self.description, "tags": ["deltaserve"],
            "timezone": "utc", "schemaVersion": 39, "version": 1, "editable": True, "graphTooltip": 1,
            "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
            "templating": {"list": templating}, "annotations": {"list": []}, "links": [],
            "panels": self.panels,
        }


MODEL_VAR = {"name": "model_name", "label": "Model", "query": "label_values(vllm:num_requests_running, model_name)"}
INSTANCE_VAR = {"name": "instance", "label": "Instance", "query": "label_values(deltaserve_build_info, instance)"}


def cluster() -> Dashboard:
    d = Dashboard("deltaserve-cluster", "deltaserve / Cluster overview",
                  "Traffic, latency SLOs, errors and saturation of the whole deployment.", [MODEL_VAR])
    d.row("Traffic")
    d.panel("Requests/s by status", [
        (f'sum by (code) (rate(deltaserve_http_requests_total{{endpoint=~"/v1/.*"}}[{RATE}]))', "{{code}}")],
        unit="reqps")
    d.panel("Tokens/s", [
        (f"sum(rate(vllm:prompt_tokens_total{{{MODEL}}}[{RATE}]))", "prompt"),
        (f"sum(rate(vllm:generation_tokens_total{{{MODEL}}}[{RATE}]))", "generated")], unit="short")
    d.panel("Finished choices/s by reason", [
        (f"sum by (finished_reason) (rate(vllm:request_success_total{{{MODEL}}}[{RATE}]))", "{{finished_reason}}")],
        unit="reqps")
    d.row("Latency SLOs (TTFT p99 <= 2 s, inter-token p99 <= 100 ms)")
    d.panel("Time to first token", quantiles("vllm:time_to_first_token_seconds", MODEL), unit="s")
    d.panel("Inter-token latency", quantiles("vllm:inter_token_latency_seconds", MODEL), unit="s")
    d.panel("End-to-end latency", quantiles("vllm:e2e_request_latency_seconds", MODEL), unit="s")
    d.row("Errors")
    d.panel("5xx ratio of /v1 requests", [(
        f'sum(rate(deltaserve_http_requests_total{{endpoint=~"/v1/.*", code=~"5.."}}[{RATE}])) / '
        f'sum(rate(deltaserve_http_requests_total{{endpoint=~"/v1/.*"}}[{RATE}]))', "5xx ratio")],
        unit="percentunit")
    d.panel("Service errors/s by code", [
        (f"sum by (code) (rate(deltaserve_request_errors_total[{RATE}]))", "{{code}}")], unit="reqps")
    d.panel("4xx/s by route", [
        (f'sum by (endpoint, code) (rate(deltaserve_http_requests_total{{code=~"4.."}}[{RATE}]))',
         "{{endpoint}} {{code}}")], unit="reqps")
    d.row("Saturation")
    d.panel("Requests running / waiting", [
        (f"sum(vllm:num_requests_running{{{MODEL}}})", "running"),
        (f"sum(vllm:num_requests_waiting{{{MODEL}}})", "waiting")])
    d.panel("Decode state slots (router view)", [
        ("sum by (state) (deltaserve_router_decode_slots)", "{{state}}")])
    d.panel("Replicas ready / draining / up", [
        ("sum(deltaserve_ready)", "ready"), ("sum(deltaserve_draining)", "draining"),
        ('sum(up{job=~"deltaserve.*"})', "up")], kind="stat")
    return d


def router() -> Dashboard:
    d = Dashboard("deltaserve-router", "deltaserve / Router",
                  "HTTP front, queue, routing inputs, prefix-cache hit rate by tenant namespace, prefix index.",
                  [MODEL_VAR, INSTANCE_VAR])
    d.row("HTTP front and queue")
    d.panel("Requests/s by route", [
        (f"sum by (endpoint) (rate(deltaserve_http_requests_total{{{INST}}}[{RATE}]))", "{{endpoint}}")],
        unit="reqps")
    d.panel("HTTP duration p99 by route",
            [quantiles("deltaserve_http_request_duration_seconds", INST, by="endpoint")[1]], unit="s")
    d.panel("In flight / waiting", [
        (f"sum(deltaserve_http_requests_in_flight{{{INST}}})", "http in flight"),
        (f"sum(vllm:num_requests_waiting{{{INST}, {MODEL}}})", "waiting for prefill")])
    d.panel("Queue time", quantiles("vllm:request_queue_time_seconds", f"{INST}, {MODEL}"), unit="s")
    d.row("Prefix cache")
    d.panel("Hit rate (tokens)", [(
        f"sum(rate(vllm:prefix_cache_hits_total{{{INST}, {MODEL}}}[{RATE}])) / "
        f"sum(rate(vllm:prefix_cache_queries_total{{{INST}, {MODEL}}}[{RATE}]))", "hit rate")],
        unit="percentunit")
    d.panel("Hit rate by tenant namespace", [(
        f"sum by (namespace) (rate(deltaserve_prefix_cache_hit_tokens_total{{{INST}}}[{RATE}])) / "
        f"sum by (namespace) (rate(deltaserve_prefix_cache_query_tokens_total{{{INST}}}[{RATE}]))",
        "{{namespace}}")], unit="percentunit",
        description="The first 16 namespaces seen by a process have their own series; the rest are 'other'.")
    d.panel("Cached prompt tokens/s by namespace", [
        (f"sum by (namespace) (rate(deltaserve_prefix_cache_hit_tokens_total{{{INST}}}[{RATE}]))", "{{namespace}}")])
    d.panel("Placements on a cached prefix", [
        (f"sum(rate(deltaserve_router_routed_to_cache_total{{{INST}}}[{RATE}])) / "
         f"sum(rate(deltaserve_router_admitted_total{{{INST}}}[{RATE}]))", "placed on a hit / admitted")],
        unit="percentunit")
    d.panel("Expected vs. served cached tokens/s", [
        (f"sum(rate(deltaserve_router_expected_cached_tokens_total{{{INST}}}[{RATE}]))", "expected at placement"),
        (f"sum(rate(vllm:prefix_cache_hits_total{{{INST}}}[{RATE}]))", "served")])
    d.panel("Index lookups (tokens/s)", [
        (f"sum by (result) (rate(deltaserve_prefix_index_lookup_tokens_total{{{INST}}}[{RATE}]))", "{{result}}")])
    d.row("Routing inputs (worker load reports)")
    d.panel("Load per worker", [
        (f"deltaserve_router_worker_load{{{INST}}}", "{{role}} {{worker}}")])
    d.panel("Free slots per worker", [
        (f"deltaserve_router_worker_free_slots{{{INST}}}", "{{worker}}")])
    d.panel("Live workers by role", [
        (f"sum by (role) (deltaserve_router_workers{{{INST}}})", "{{role}}")])
    d.row("Prefix index (RocksDB)")
    d.panel("Index events applied/s", [
        (f"sum(rate(deltaserve_prefix_index_events_total{{{INST}}}[{RATE}]))", "events")])
    d.panel("Index entries / bytes", [
        (f"sum(deltaserve_prefix_index_entries{{{INST}}})", "entries"),
        (f"sum(deltaserve_prefix_index_bytes{{{INST}}})", "bytes")])
    d.panel("Write latency", quantiles("deltaserve_prefix_index_write_duration_seconds", INST), unit="s")
    d.panel("Index errors/s (lookups, writes, reconciles)", [
        (f"sum(rate(deltaserve_prefix_index_errors_total{{{INST}}}[{RATE}]))", "errors")])
    return d


def workers() -> Dashboard:
    d = Dashboard("deltaserve-workers", "deltaserve / Workers",
                  "Prefill and decode processes: batch, tokens/s, state slots, MLA pages, KDA checkpoints, handoffs.",
                  [INSTANCE_VAR])
    d.row("Batch and throughput")
    d.panel("Requests held (batch) per instance", [
        (f'sum by (instance) (deltaserve_worker_requests{{state="active", {INST}}})', "{{instance}} active"),
        (f'sum by (instance) (deltaserve_worker_requests{{state="queued", {INST}}})', "{{instance}} queued")])
    d.panel("Steps/s (decode steps, prefill chunks)", [
        (f"sum by (instance) (rate(deltaserve_worker_steps_total{{{INST}}}[{RATE}]))", "{{instance}}")])
    d.panel("Generated tokens/s (cluster)", [
        (f"sum(rate(vllm:generation_tokens_total[{RATE}]))", "tokens/s")])
    d.row("Memory: state slots, MLA pages, KDA checkpoints")
    d.panel("State slots (decode: KDA batch; prefill: fixed pool)", [
        (f"sum by (role, state) (deltaserve_kda_state_slots{{{INST}}})", "{{role}} {{state}}")])
    d.panel("MLA page groups", [
        (f"sum by (state) (deltaserve_mla_pages{{{INST}}})", "{{state}}"),
    ])
    d.panel("KV cache usage", [(f"vllm:kv_cache_usage_perc{{{INST}}}", "{{instance}}")], unit="percentunit")
    d.panel("Prefix cache: entries and KDA checkpoints", [
        (f"sum(deltaserve_prefix_cache_entries{{{INST}}})", "entries (block boundaries with pages)"),
        (f"sum(deltaserve_kda_checkpoints{{{INST}}})", "checkpoints")])
    d.panel("KDA checkpoint bytes / budget", [
        (f"sum(deltaserve_kda_checkpoint_bytes{{{INST}}})", "bytes"),
        (f"sum(deltaserve_kda_checkpoint_budget_bytes{{{INST}}})", "budget")], unit="bytes")
    d.panel("Prefix-cache evictions/s", [
        (f"sum(rate(deltaserve_prefix_cache_evictions_total{{{INST}}}[{RATE}]))", "entries + checkpoints")])
    d.row("Handoffs (prefill to decode: MLA pages + KDA states)")
    d.panel("Handoffs/s by result", [
        (f"sum by (transport, result) (rate(deltaserve_handoffs_total{{{INST}}}[{RATE}]))",
         "{{transport}} {{result}}")], unit="ops")
    d.panel("Handoff bytes/s", [
        (f"sum by (transport) (rate(deltaserve_handoff_bytes_total{{{INST}}}[{RATE}]))", "{{transport}}")],
        unit="Bps")
    d.panel("Handoff duration", [
        (f"sum(rate(deltaserve_handoff_seconds_total{{{INST}}}[{RATE}])) / "
         f'sum(rate(deltaserve_handoffs_total{{result="ok", {INST}}}[{RATE}]))', "mean"),
        quantiles("deltaserve_handoff_duration_seconds", INST)[1]], unit="s")
    return d


def main() -> int:
    check = "--check" in sys.argv[1:]
    stale = []
    for dashboard in (cluster(), router(), workers()):
        name = dashboard.uid.removeprefix("deltaserve-") + ".json"
        path = os.path.join(HERE, name)
        text = json.dumps(dashboard.json(), indent=2, sort_keys=True) + "\n"
        if check:
            with open(path, encoding="utf-8") as f:
                if f.read() != text:
                    stale.append(name)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
    if stale:
        print(f"stale dashboards (run python3 dashboards/generate.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
