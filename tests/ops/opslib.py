"""Helpers of the ops checks: PromQL metric names, the dashboards' and rules' queries, scrape parsing,
promtool, and the metrics that are declared but not yet filled.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARDS = sorted(glob.glob(os.path.join(REPO, "dashboards", "*.json")))
RULES = os.path.join(REPO, "deploy", "prometheus", "deltaserve-rules.yml")
RULE_TESTS = os.path.join(REPO, "deploy", "prometheus", "deltaserve-rules.test.yml")
METRICS_CPP = os.path.join(REPO, "telemetry", "metrics.cpp")

# Families telemetry/ declares whose values come from the actors' side of the snapshot API
# (telemetry/snapshots.hpp), which the actors do not call yet: declared, never sampled in a live
# scrape today. Each must be declared in telemetry/metrics.cpp; the live check prints the ones that
# have started to appear so this list can shrink.
PENDING_ACTOR_WIRING = {
    # Prefix-index lookups and writes happen only in a router with --index-dir (the live checks run without).
    "deltaserve_prefix_index_lookup_tokens_total",
    "deltaserve_prefix_index_write_duration_seconds",
}
# Families that get their first series only when the event happens (a service-side request failure).
ON_EVENT = {"deltaserve_request_errors_total"}
# Series Prometheus makes itself.
FROM_PROMETHEUS = {"up"}

_FUNCTIONS_AND_KEYWORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile", "by", "without",
    "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset", "abs", "clamp_min",
    "clamp_max", "label_values", "topk", "bottomk", "delta", "deriv", "time", "vector", "scalar", "absent",
}


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (label names, functions and keywords left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)  # label lists
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = m.group(0)
        following = text[m.end():].lstrip()[:1]
        if word in _FUNCTIONS_AND_KEYWORDS or following == "(":
            continue
        if re.fullmatch(r"[0-9.e+-]+", word) or word.startswith("$"):
            continue
        names.add(word)
    return names


def base_name(sample_name: str) -> str:
    for suffix in ("_bucket", "_count", "_sum"):
        if sample_name.endswith(suffix):
            return sample_name[: -len(suffix)]
    return sample_name


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, expr) for every panel target and query variable of every dashboard."""
    out = []
    for path in DASHBOARDS:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        name = os.path.basename(path)
        for panel in d["panels"]:
            for t in panel.get("targets", []):
                out.append((f"{name}: {panel['title']}", t["expr"]))
        for v in d["templating"]["list"]:
            if v["type"] == "query":
                m = re.fullmatch(r"label_values\(([^,]+),\s*\w+\)", v["definition"])
                assert m, f"{name}: variable {v['name']}: unexpected query {v['definition']}"
                out.append((f"{name}: variable {v['name']}", m.group(1)))
    return out


def rule_queries() -> list[tuple[str, str]]:
    with open(RULES, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    return [(f"rule {r.get('alert') or r.get('record')}", r["expr"]) for g in doc["groups"] for r in g["rules"]]


def recorded_names() -> set[str]:
    with open(RULES, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    return {r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}


def declared_families() -> set[str]:
    """Family names telemetry/metrics.cpp registers (.Name("...") calls)."""
    with open(METRICS_CPP, encoding="utf-8") as f:
        return set(re.findall(r'\.Name\("([^"]+)"\)', f.read()))


def parse_scrape(text: str) -> dict[str, dict[str, float]]:
    """{sample name: {label text: value}} of a text-format scrape."""
    samples: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)(\s+\d+)?", line)
        assert m, f"unparsable sample line: {line!r}"
        samples.setdefault(m.group(1), {})[m.group(2) or ""] = float(m.group(3))
    return samples


def value(samples: dict[str, dict[str, float]], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for label_text, v in samples.get(name, {}).items():
        if all(f'{k}="{val}"' in label_text for k, val in labels.items()):
            total += v
    return total


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool not found: install the Debian package `prometheus` (scripts/setup-debian.sh)"
    return path


def promtool_check_metrics(text: str) -> tuple[int, str]:
    proc = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout + proc.stderr
