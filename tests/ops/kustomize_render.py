"""Renders deltaserve's kustomizations (deploy/kustomize) without kubectl or kustomize binaries.

Debian 12 packages neither, so the ops checks render the overlays with this small subset of
kustomize, the part our kustomizations use, and fail loudly on anything else:
  resources (files and directories with a kustomization.yaml), namespace, labels (pairs,
  includeSelectors: false: metadata.labels only), images (name, newName, newTag) and patches
  (strategic-merge files with a target kind + name; lists of objects that carry a `name` merge by
  name, other lists are replaced, as kustomize does for the fields we patch).
When a real `kubectl` is on PATH the checks compare its `kubectl kustomize` output with ours.

    python3 tests/ops/kustomize_render.py deploy/kustomize/overlays/disaggregated
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "resources", "namespace", "labels", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PriorityClass",
                  "StorageClass"}


class RenderError(Exception):
    pass


def _load_all(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def _merge(base: Any, patch: Any) -> Any:
    """Strategic merge, as far as our patches need it."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if (isinstance(base, list) and isinstance(patch, list) and base and patch
            and all(isinstance(x, dict) and "name" in x for x in base + patch)):
        out = [copy.deepcopy(x) for x in base]
        for item in patch:
            for i, existing in enumerate(out):
                if existing["name"] == item["name"]:
                    out[i] = _merge(existing, item)
                    break
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def _containers(resource: dict) -> list[dict]:
    spec = resource.get("spec", {})
    pod = spec.get("template", {}).get("spec", {}) if "template" in spec else spec if resource["kind"] == "Pod" else {}
    return list(pod.get("containers", [])) + list(pod.get("initContainers", []))


def render(directory: str) -> list[dict]:
    """The resources of the kustomization in `directory`, transformed, in input order."""
    path = os.path.join(directory, "kustomization.yaml")
    if not os.path.exists(path):
        raise RenderError(f"{directory}: no kustomization.yaml")
    with open(path, encoding="utf-8") as f:
        k = yaml.safe_load(f) or {}
    unknown = set(k) - KNOWN_KEYS
    if unknown:
        raise RenderError(f"{path}: fields this renderer does not implement: {sorted(unknown)}")

    resources: list[dict] = []
    for entry in k.get("resources", []):
        target = os.path.normpath(os.path.join(directory, entry))
        if os.path.isdir(target):
            resources.extend(render(target))
        elif os.path.isfile(target):
            resources.extend(_load_all(target))
        else:
            raise RenderError(f"{path}: resource {entry} does not exist")

    for patch in k.get("patches", []):
        if set(patch) - {"path", "target"} or "path" not in patch:
            raise RenderError(f"{path}: only `path` + `target` patches are implemented: {patch}")
        target = patch.get("target", {})
        if set(target) - {"kind", "name"}:
            raise RenderError(f"{path}: patch targets by kind and name only: {target}")
        body = _load_all(os.path.join(directory, patch["path"]))
        if len(body) != 1:
            raise RenderError(f"{patch['path']}: one strategic-merge patch per file")
        body = copy.deepcopy(body[0])
        kind = target.get("kind", body.get("kind"))
        name = target.get("name", body.get("metadata", {}).get("name"))
        if target:  # kustomize ignores the patch's own name when a target picks the resource
            body.get("metadata", {}).pop("name", None)
        hits = [i for i, r in enumerate(resources) if r["kind"] == kind and r["metadata"]["name"] == name]
        if not hits:
            raise RenderError(f"{path}: patch {patch['path']} matches no {kind}/{name}")
        for i in hits:
            resources[i] = _merge(resources[i], body)

    for label in k.get("labels", []):
        if label.get("includeSelectors", False) or label.get("includeTemplates", False):
            raise RenderError(f"{path}: labels with includeSelectors/includeTemplates are not implemented")
        for r in resources:
            r.setdefault("metadata", {}).setdefault("labels", {}).update(label.get("pairs", {}))

    for image in k.get("images", []):
        for r in resources:
            for c in _containers(r):
                current = c.get("image", "")
                bare = current.split("@")[0].rsplit(":", 1)[0] if ":" in current.split("/")[-1] else current
                if bare != image["name"]:
                    continue
                name = image.get("newName", bare)
                tag = image.get("newTag")
                if tag is None and ":" in current.split("/")[-1]:
                    tag = current.rsplit(":", 1)[1]
                c["image"] = f"{name}:{tag}" if tag else name

    if "namespace" in k:
        for r in resources:
            if r["kind"] not in CLUSTER_SCOPED:
                r.setdefault("metadata", {})["namespace"] = k["namespace"]
    return resources


def main() -> int:
    for directory in sys.argv[1:]:
        print(yaml.safe_dump_all(render(directory), sort_keys=False), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
