"""Render a kustomization the way ``kubectl kustomize`` does, for the subset of kustomize the
manifests in ``deploy/kubernetes/`` use (``kubectl`` is not available offline here).

Supported: ``resources`` (files, or folders holding a kustomization), ``namespace``,
``patches`` given by ``path`` (strategic merge patches, the target named by the patch's kind
and metadata.name) and ``images`` (``newName``/``newTag``). Any other field is refused, so a
manifest change that needs more kustomize fails here instead of being ignored.

Strategic merge: maps merge key by key; the lists Kubernetes merges by key (containers and
volumes by name, env by name, volumeMounts by mountPath, container ports by containerPort)
merge item by item; every other list is replaced, as the API's patch strategy says.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}


def _merge(base: Any, patch: Any, key: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for k, v in patch.items():
            merged[k] = _merge(base[k], v, k) if k in base else v
        return merged
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        field = MERGE_KEYS[key]
        if all(isinstance(i, dict) and field in i for i in base + patch):
            merged = list(base)
            for item in patch:
                at = next((n for n, old in enumerate(merged) if old[field] == item[field]), None)
                if at is None:
                    merged.append(item)
                else:
                    merged[at] = _merge(merged[at], item)
            return merged
    return patch


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _set_images(doc: dict[str, Any], images: list[dict[str, str]]) -> None:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        name, _, tag = container["image"].partition(":")
        for image in images:
            if image["name"] == name:
                name = image.get("newName", name)
                tag = image.get("newTag", tag)
                container["image"] = f"{name}:{tag}" if tag else name


def build(directory: Path) -> list[dict[str, Any]]:
    """The documents ``kubectl kustomize directory`` would print."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED
    if unknown:
        raise ValueError(f"{directory}: kustomization fields not supported here: {sorted(unknown)}")
    docs: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        docs += build(path) if path.is_dir() else _load(path)
    for entry in kustomization.get("patches", []):
        if set(entry) != {"path"}:
            raise ValueError(f"{directory}: only patches given by path are supported, got {entry}")
        for patch in _load(directory / entry["path"]):
            matches = [n for n, doc in enumerate(docs) if doc["kind"] == patch["kind"]
                       and doc["metadata"]["name"] == patch["metadata"]["name"]]
            if len(matches) != 1:
                raise ValueError(f"{entry['path']}: patch target {patch['kind']}/{patch['metadata']['name']} "
                                 f"matches {len(matches)} resources")
            docs[matches[0]] = _merge(docs[matches[0]], patch)
    for doc in docs:
        _set_images(doc, kustomization.get("images", []))
        if "namespace" in kustomization and doc["kind"] not in CLUSTER_SCOPED:
            doc["metadata"]["namespace"] = kustomization["namespace"]
    return docs
