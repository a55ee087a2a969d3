"""Shared helpers for the offline deployment checks: render the Helm chart with the helm binary that
scripts/install_ci_tools.sh puts in .tools/bin, and look things up in the rendered manifests.

A plain module rather than a conftest.py, so its import name cannot clash with other test folders."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "specdec"
CI_VALUES = CHART / "ci"
DOCKER_DIR = REPO / "deploy" / "docker"
HELM = REPO / ".tools" / "bin" / "helm"
RELEASE = "sd"
NAMESPACE = "llm"
# The Kubernetes version the manifests are validated against: the one the bundled helm (v4.1, client v1.35)
# targets, and the oldest the chart supports (Chart.yaml kubeVersion).
KUBE_VERSIONS = ("1.35.0", "1.30.0")
# Values files rendered in CI: "default" is the chart with no values file.
VALUES_CASES = ("default", "cpu", "gpu-pair", "split", "tls", "tracing", "colocated")
# The containers that run a specdec service (the helm test Pod's is "generate").
SPECDEC_CONTAINERS = frozenset({"gateway", "draft", "target"})


def helm_path() -> Path:
    if not HELM.is_file():
        pytest.fail(f"{HELM} is missing: run `bash scripts/install_ci_tools.sh` (scripts/test.sh does) first")
    return HELM


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm_path()), *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def values_args(case: str) -> list[str]:
    return [] if case == "default" else ["-f", str(CI_VALUES / f"{case}-values.yaml")]


def template_args(case: str, *extra: str) -> list[str]:
    return [
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        KUBE_VERSIONS[0],
        *values_args(case),
        *extra,
    ]


@functools.cache
def render_text(case: str, *extra: str) -> str:
    return run_helm(*template_args(case, *extra)).stdout


def render(case: str, *extra: str) -> list[dict]:
    """The rendered manifests (helm test hooks included) as a list of dicts."""
    return [doc for doc in yaml.safe_load_all(render_text(case, *extra)) if doc]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def pod_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Pod")]


def container(doc: dict, name: str) -> dict:
    by_name = {c["name"]: c for c in pod_spec(doc)["containers"]}
    assert name in by_name, f"{doc['kind']}/{doc['metadata']['name']} has no container {name!r}"
    return by_name[name]


def flag(c: dict, name: str) -> str | None:
    """The value of `--name=VALUE` in a container's args (None when absent)."""
    values = [a.split("=", 1)[1] for a in c.get("args", []) if a.startswith(f"--{name}=")]
    assert len(values) <= 1, f"--{name} given {len(values)} times"
    return values[0] if values else None


def flags(c: dict, name: str) -> list[str]:
    return [a.split("=", 1)[1] for a in c.get("args", []) if a.startswith(f"--{name}=")]


def specdec_containers(docs: list[dict]):
    """(workload, container) for every gateway/draft/target container."""
    for doc in workloads(docs):
        for c in pod_spec(doc)["containers"]:
            if c["name"] in SPECDEC_CONTAINERS:
                yield doc, c


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def ci_values(case: str) -> dict:
    return yaml.safe_load((CI_VALUES / f"{case}-values.yaml").read_text())
