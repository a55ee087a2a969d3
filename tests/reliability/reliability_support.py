"""Helpers of the reliability suite: services in-process or as processes, KV accounting, test certificates."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from repo_paths import REPO, TINY

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services"))
from cert_factory import creds, make_certs  # noqa: E402
from services_stack import ServiceThread, start_draft, start_target  # noqa: E402

from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc  # noqa: E402

__all__ = ["ServiceThread", "creds", "make_certs", "start_draft", "start_target"]

TARGET_DIR, DRAFT_DIR = str(TINY / "target"), str(TINY / "draft")
TARGET_HEALTH, DRAFT_HEALTH, GATEWAY_HEALTH = (
    "specdec.v1.TargetService", "specdec.v1.DraftService", "specdec.v1.GatewayService")
PROMPT_IDS = [1, 331, 288, 1093, 297, 40, 77, 12, 905, 11]  # any ids of the tiny vocabulary (8192)


def start_gateway(*pairs: str, extra: tuple[str, ...] = ()) -> ServiceThread:
    from gateway.serve import serve

    argv = ["serve-gateway", "--model", TARGET_DIR, "--port", "0", "--drain-seconds", "2"]
    for pair in pairs:
        argv += ["--pair", pair]
    gateway = ServiceThread(serve, [*argv, *extra]).start()
    if not any("tls" in a for a in extra):
        wait_pairs_up(gateway.addr, len(pairs))
    return gateway


def wait_pairs_up(addr: str, n: int, timeout_s: float = 30.0) -> float:
    """Wait until the gateway's ListModels reports n pairs up (its health loop has seen them)."""
    from specdec.v1 import gateway_pb2, gateway_pb2_grpc

    t0 = time.monotonic()
    with grpc.insecure_channel(addr) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        while stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=5).models[0].pairs_up != n:
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"the gateway at {addr} did not see {n} pairs up in {timeout_s} s")
            time.sleep(0.1)
    return time.monotonic() - t0


def target_kv(addr: str, creds: grpc.ChannelCredentials | None = None) -> tuple[int, int, int]:
    """(pages_free, pages_total, num_running) of a target service."""
    with _channel(addr, creds) as ch:
        info = target_pb2_grpc.TargetServiceStub(ch).GetModelInfo(
            target_pb2.TargetServiceGetModelInfoRequest(), timeout=10)
    return info.kv.pages_free, info.kv.pages_total, info.num_running


def draft_kv(addr: str, creds: grpc.ChannelCredentials | None = None) -> tuple[int, int, int]:
    with _channel(addr, creds) as ch:
        info = draft_pb2_grpc.DraftServiceStub(ch).GetModelInfo(draft_pb2.DraftServiceGetModelInfoRequest(), timeout=10)
    return info.kv.pages_free, info.kv.pages_total, info.num_running


def wait_whole(kv_fn, addr: str, timeout_s: float = 15.0) -> tuple[int, int, int]:
    """Poll until every page is free and nothing runs; returns the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        kv = kv_fn(addr)
        if (kv[0] == kv[1] and kv[2] == 0) or time.monotonic() > deadline:
            return kv
        time.sleep(0.05)


def health(addr: str, service: str = "", creds: grpc.ChannelCredentials | None = None) -> int:
    with _channel(addr, creds) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            return reply.status
        except grpc.RpcError:
            return -1


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _channel(addr: str, creds: grpc.ChannelCredentials | None) -> grpc.Channel:
    return grpc.secure_channel(addr, creds) if creds else grpc.insecure_channel(addr)


# ---- services as processes ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceProcess:
    """`python -m specdec <argv> --port P` as a child process; `wait_serving`, `kill`, `terminate`."""

    def __init__(self, argv: list[str], port: int | None = None, log_dir: Path | None = None):
        self.port = port or free_port()
        self.argv = [sys.executable, "-m", "specdec", *argv, "--host", "127.0.0.1", "--port", str(self.port)]
        self.log_path = (log_dir or Path("/tmp")) / f"{argv[0]}-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> ServiceProcess:
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        log = open(self.log_path, "wb")  # noqa: SIM115 - kept for the child's lifetime
        self.proc = subprocess.Popen(self.argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self

    def wait_serving(self, service: str, timeout_s: float = 120.0) -> ServiceProcess:
        deadline = time.monotonic() + timeout_s
        while health(self.addr, service) != SERVING:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.argv[3]} did not start: {self.log()[-2000:]}")
            time.sleep(0.2)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def terminate(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def target_process(*extra: str, port: int | None = None, log_dir: Path | None = None) -> ServiceProcess:
    return ServiceProcess(["serve-target", "--model", TARGET_DIR, "--drain-seconds", "2", *extra], port, log_dir)


def draft_process(target_addr: str, *extra: str, log_dir: Path | None = None) -> ServiceProcess:
    return ServiceProcess(["serve-draft", "--model", DRAFT_DIR, "--target-model", TARGET_DIR,
                           "--target", target_addr, "--drain-seconds", "2", "--speculation", "always", *extra],
                          None, log_dir)
