"""Ops artefacts checked without a cluster: dashboards, alert rules (promtool), Kubernetes manifests
(rendered and validated against the Kubernetes schemas offline), probes vs. drain, and Dockerfiles.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

import opslib
from kustomize_render import render

REPO = opslib.REPO
OVERLAYS = ["embedded", "disaggregated"]
KUBERNETES_VERSION = "1.32.0"  # the oldest minor we promise; the schemas ship with kubernetes-validate


# ---- dashboards -------------------------------------------------------------------------------------

def test_dashboards_are_generated_and_current():
    assert len(opslib.DASHBOARDS) == 3, opslib.DASHBOARDS
    proc = subprocess.run([sys.executable, os.path.join(REPO, "dashboards", "generate.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", opslib.DASHBOARDS, ids=os.path.basename)
def test_dashboard_is_grafana_json_with_a_datasource_variable(path):
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    queries = 0
    for panel in d["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], f"{panel['title']}: no query"
        for t in panel["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", panel["title"]
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            queries += 1
    assert queries >= 10


def test_metric_names_of_dashboards_and_rules_are_declared():
    """Every name a query reads is a family telemetry/ declares, a recording rule, or Prometheus's own.
    (tests/ops/test_live_metrics.py checks them against a live scrape.)"""
    declared = opslib.declared_families()
    allowed = declared | opslib.recorded_names() | opslib.FROM_PROMETHEUS
    unknown = []
    for where, expr in opslib.dashboard_queries() + opslib.rule_queries():
        for name in opslib.metric_names(expr):
            if name not in allowed and opslib.base_name(name) not in declared:
                unknown.append(f"{where}: {name}")
    assert not unknown, "metrics no process exports:\n" + "\n".join(unknown)
    missing = (opslib.PENDING_ACTOR_WIRING | opslib.ON_EVENT) - declared
    assert not missing, f"allow-listed names that telemetry/ does not declare: {sorted(missing)}"


# ---- alert rules ------------------------------------------------------------------------------------

def test_promtool_check_rules():
    proc = subprocess.run([opslib.promtool(), "check", "rules", opslib.RULES], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_test_rules():
    proc = subprocess.run([opslib.promtool(), "test", "rules", opslib.RULE_TESTS], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(opslib.RULE_TESTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_a_unit_test():
    with open(opslib.RULES, encoding="utf-8") as f:
        alerts = {r["alert"] for g in yaml.safe_load(f)["groups"] for r in g["rules"] if "alert" in r}
    with open(opslib.RULE_TESTS, encoding="utf-8") as f:
        tests = yaml.safe_load(f)["tests"]
    fired = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if a.get("exp_alerts")}
    assert alerts - fired == set(), f"alerts no test expects to fire: {sorted(alerts - fired)}"


def test_adapter_rule_and_scrape_config_are_well_formed():
    with open(os.path.join(REPO, "deploy", "prometheus", "adapter-rules.yaml"), encoding="utf-8") as f:
        adapter = yaml.safe_load(f)
    (rule,) = adapter["rules"]
    assert rule["name"]["as"] == "deltaserve_kda_state_slot_utilization"
    assert "deltaserve_kda_state_slots" in opslib.declared_families()
    # Debian's promtool is built without Kubernetes service discovery, so `promtool check config`
    # cannot read this file here; check its shape and that the rule file it names exists.
    with open(os.path.join(REPO, "deploy", "prometheus", "prometheus.yml"), encoding="utf-8") as f:
        config = yaml.safe_load(f)
    for rule_file in config["rule_files"]:
        assert os.path.exists(os.path.join(REPO, "deploy", "prometheus", rule_file)), rule_file
    (job,) = config["scrape_configs"]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"


# ---- Kubernetes manifests ---------------------------------------------------------------------------

@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request):
    return request.param, render(os.path.join(REPO, "deploy", "kustomize", "overlays", request.param))


def by_kind(resources, kind):
    return [r for r in resources if r["kind"] == kind]


def test_manifests_validate_against_the_kubernetes_schemas(overlay):
    name, resources = overlay
    assert len(resources) >= 5
    for r in resources:
        try:
            kubernetes_validate.validate(r, KUBERNETES_VERSION, strict=True)
        except Exception as e:  # jsonschema's ValidationError or kubernetes_validate's own errors
            pytest.fail(f"{name}: {r['kind']}/{r['metadata']['name']}: {e}")
        assert r["metadata"]["namespace"] == "deltaserve"


def test_renderer_matches_kubectl_kustomize_when_available(overlay):
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("no kubectl on PATH (Debian does not package it): the renderer is checked by the others")
    name, ours = overlay
    proc = subprocess.run([kubectl, "kustomize", os.path.join(REPO, "deploy", "kustomize", "overlays", name)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    theirs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    key = lambda r: (r["kind"], r["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, ours)) == sorted(map(key, theirs))
    theirs_by_key = {key(r): r for r in theirs}
    for r in ours:
        assert r == theirs_by_key[key(r)], f"{name}: {key(r)} differs from kubectl kustomize"


def selected(selector, resources):
    return [r for r in resources if r["kind"] == "Deployment"
            and all(r["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items())]


def test_services_pdbs_and_hpa_point_at_real_pods(overlay):
    name, resources = overlay
    for svc in by_kind(resources, "Service"):
        pods = selected(svc["spec"]["selector"], resources)
        assert pods, f"{name}: Service {svc['metadata']['name']} selects no Deployment"
        for port in svc["spec"]["ports"]:
            names = {p["name"] for d in pods for c in d["spec"]["template"]["spec"]["containers"]
                     for p in c.get("ports", [])}
            assert port["targetPort"] in names, f"{name}: {svc['metadata']['name']} port {port['targetPort']}"
    for pdb in by_kind(resources, "PodDisruptionBudget"):
        assert selected(pdb["spec"]["selector"]["matchLabels"], resources), pdb["metadata"]["name"]
    deployments = {d["metadata"]["name"] for d in by_kind(resources, "Deployment")}
    for hpa in by_kind(resources, "HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments


def role_config(resources, role):
    (cm,) = [c for c in by_kind(resources, "ConfigMap") if c["metadata"]["name"] == "deltaserve-config"]
    return json.loads(cm["data"][f"{role}.json"])


def test_probes_and_termination_grace_match_the_drain(overlay):
    """SIGTERM comes after the preStop sleep; the process then drains for drain_timeout_ms and exits.
    The grace period must cover both, or Kubernetes SIGKILLs streams that were allowed to finish."""
    name, resources = overlay
    for d in by_kind(resources, "Deployment"):
        pod = d["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        role = c["args"][0]
        assert c["args"][1:3] == ["--config", f"/etc/deltaserve/config/{role}.json"], c["args"]
        config = role_config(resources, role)
        pre_stop = 0
        if "lifecycle" in c:
            command = c["lifecycle"]["preStop"]["exec"]["command"]
            assert command[0] == "/bin/sleep"
            pre_stop = int(command[1])
        grace = pod["terminationGracePeriodSeconds"]
        assert grace >= pre_stop + config["drain_timeout_ms"] / 1000 + 5, (d["metadata"]["name"], grace)
        assert {"startupProbe", "livenessProbe", "readinessProbe"} <= set(c), d["metadata"]["name"]
        assert "metrics_listen" in config and c["ports"][-1]["containerPort"] == int(config["metrics_listen"].split(":")[1])
        annotations = d["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == config["metrics_listen"].split(":")[1]
        if role in ("serve", "router"):  # the HTTP front: liveness /health, readiness /ready, preStop
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
            assert c["readinessProbe"]["failureThreshold"] == 1  # out of the endpoints at the first 503
            assert pre_stop > 0
        else:  # workers: no HTTP front; their metrics listener is what a probe can reach
            assert c["livenessProbe"]["httpGet"]["port"] == "metrics"
            assert c["livenessProbe"]["httpGet"]["path"] == "/health"  # fails once orphaned (no router)
            assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
            assert pod["nodeSelector"] and pod["tolerations"], "GPU placement patch not applied"
            # A worker that holds a GPU runs the model on it (not on the CPU beside it).
            assert config.get("device") == "cuda", f"{d['metadata']['name']}: --device cuda not set"
            assert 0 < config.get("gpu_memory_fraction", 0.9) <= 1


def test_config_files_use_only_flags_the_binary_knows(overlay):
    """A --config key a role does not know is a startup error; compare with `deltaserve ROLE --help`."""
    import ds_integration as ds
    ds.require_binary()
    name, resources = overlay
    (cm,) = [c for c in by_kind(resources, "ConfigMap") if c["metadata"]["name"] == "deltaserve-config"]
    for key in cm["data"]:
        role = key.removesuffix(".json")
        help_text = subprocess.run([ds.BINARY, role, "--help"], capture_output=True, text=True, timeout=30).stdout
        for flag in json.loads(cm["data"][key]):
            assert f"--{flag.replace('_', '-')}" in help_text, f"{key}: `{flag}` is not a flag of `{role}`"


# ---- Dockerfiles ------------------------------------------------------------------------------------

DOCKERFILES = sorted(os.path.join(REPO, "deploy", "docker", f) for f in os.listdir(os.path.join(REPO, "deploy", "docker"))
                     if f.startswith("Dockerfile"))


def instructions(path):
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, current = [], ""
    with open(path, encoding="utf-8") as f:
        for line in f:
            stripped = line.strip()
            if not current and (not stripped or stripped.startswith("#")):
                continue
            current += stripped[:-1] + " " if stripped.endswith("\\") else stripped
            if not stripped.endswith("\\"):
                word, _, rest = current.partition(" ")
                out.append((word.upper(), rest.strip()))
                current = ""
    return out


@pytest.mark.parametrize("path", DOCKERFILES, ids=os.path.basename)
def test_dockerfile_structure(path):
    steps = instructions(path)
    assert len(DOCKERFILES) == 2
    assert steps[0][0] in ("FROM", "ARG"), "a Dockerfile starts with FROM (or ARG)"
    stages, final_user, entrypoint = [], None, None
    for word, args in steps:
        assert word in {"FROM", "ARG", "RUN", "COPY", "ENV", "USER", "EXPOSE", "ENTRYPOINT", "CMD", "WORKDIR",
                        "LABEL"}, word
        if word == "FROM":
            image, _, alias = args.partition(" AS ")
            assert re.search(r":[\w.-]+$", image) and not image.endswith(":latest"), f"unpinned base image {image}"
            stages.append(alias.strip())
            final_user, entrypoint = None, None
        elif word == "COPY":
            parts = args.split()
            flags = [p for p in parts if p.startswith("--")]
            sources = [p for p in parts if not p.startswith("--")][:-1]
            source_stage = next((f.split("=", 1)[1] for f in flags if f.startswith("--from=")), None)
            if source_stage:
                assert source_stage in stages[:-1], f"COPY --from={source_stage}: no earlier stage of that name"
            else:
                for s in sources:
                    assert os.path.exists(os.path.join(REPO, s)), f"COPY source {s} is not in the repository"
        elif word == "RUN":
            for script in re.findall(r"/src/([\w./-]+\.sh)", args):
                assert os.path.exists(os.path.join(REPO, script)), f"RUN uses {script}, which is not in the repository"
                assert os.access(os.path.join(REPO, script), os.X_OK), f"{script} is not executable"
            if "apt-get install" in args:
                assert "--no-install-recommends" in args
        elif word == "USER":
            final_user = args
        elif word == "ENTRYPOINT":
            entrypoint = json.loads(args)  # exec form, so SIGTERM reaches deltaserve (PID 1) for the drain
    assert final_user not in (None, "root", "0"), "the run stage must not run as root"
    assert entrypoint and entrypoint[0].endswith("/deltaserve")
