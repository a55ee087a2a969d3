"""Target, draft and gateway as local processes (`specdec up`, and `specdec generate` without a gateway).

    with LocalStack(StackConfig.free_ports()) as stack:   # starts all three, waits until each is SERVING
        print(stack.gateway_addr)

Each service runs as `python -m specdec serve-*` in its own session, so a terminal's Ctrl-C reaches only this
process, which then stops them in order (gateway, draft, target) with SIGTERM, and SIGKILL after a grace period.
Should this process die without stopping them (SIGKILL), each stops itself: it is started with
`EXIT_WITH_PARENT_ENV` naming this process (`specdec.rpc.parent_watch`).
`supervise` restarts a service whose process exits, as Kubernetes restarts a container: meanwhile the gateway
serves what it can (a dead draft: its target's plain decoding; the gateway's health loop takes the service back
once it answers SERVING again). One that keeps dying within `QUICK_S` of each start is restarted after 1, 2, 4,
8 s, and given up on at the `RESTARTS`-th (fifth) such death in a row.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.stack_flags import read_flags, refuse_passed
from specdec.errors import ConfigError, NotReady
from specdec.rpc.parent_watch import child_env

REPO_ROOT = Path(__file__).resolve().parents[1]
BUNDLED_MODELS_ENV = "SPECDEC_BUNDLED_MODELS"  # where the bundled tiny pair lies when not beside the package


def bundled_models() -> Path:
    """The bundled tiny pair: `$SPECDEC_BUNDLED_MODELS`, else beside the package (a checkout, an editable install),
    else the images' copy. A plain `pip install .` puts the package in site-packages, where the default pointed at
    a folder that does not exist (QA: a bare `docker run ... up`)."""
    beside = REPO_ROOT / "models" / "tiny-code"
    candidates = [os.environ.get(BUNDLED_MODELS_ENV, ""), beside, "/opt/specdec/models/tiny-code"]
    return next((Path(c) for c in candidates if c and Path(c).is_dir()), beside)


BUNDLED_MODELS = bundled_models()
DEFAULT_TARGET_DIR = BUNDLED_MODELS / "target"
DEFAULT_DRAFT_DIR = BUNDLED_MODELS / "draft"
DEFAULT_PORTS = {"gateway": 50050, "draft": 50051, "target": 50052}
HEALTH_NAMES = {
    "target": "specdec.v1.TargetService",
    "draft": "specdec.v1.DraftService",
    "gateway": "specdec.v1.GatewayService",
}
STOP_ORDER = ("gateway", "draft", "target")
PASSED_IN = {"target": "--target-args", "draft": "--draft-args", "gateway": "--gateway-args"}  # `up`'s options
RESTARTS = 5  # deaths in a row, each within QUICK_S of its start, after which `supervise` gives up
QUICK_S = 60.0
MAX_BACKOFF_S = 16.0
STOP_GRACE_S = 35.0  # each service's time to drain on stop: above their default --drain-seconds (30)
# what stops a stack as Ctrl-C does: a closed terminal or a dropped SSH session sends SIGHUP
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class _Life:
    """A service's restarts: when it last started, its quick deaths in a row, when it is due to start again."""

    started: float
    quick: int = 0
    due: float | None = None  # set while it is dead and waiting out its backoff


@dataclass(frozen=True)
class StackConfig:
    target_dir: str = str(DEFAULT_TARGET_DIR)
    draft_dir: str | None = str(DEFAULT_DRAFT_DIR)  # None: no draft (the gateway uses plain Generate)
    device: str = "cpu"
    host: str = "127.0.0.1"
    gateway_port: int = DEFAULT_PORTS["gateway"]
    draft_port: int = DEFAULT_PORTS["draft"]
    target_port: int = DEFAULT_PORTS["target"]
    verify_lane_port: int = 0  # the target's verify lane (docs/protocol.md); 0: any free port (its draft asks)
    speculation: str = "auto"  # the draft's --speculation (auto: per step, whichever is measured faster)
    colocated: bool = False  # the draft runs the target in its own process (`--target in-process`): no target process
    # more `serve-target` / `serve-draft` / `serve-gateway` flags (`up --target-args`, `--draft-args`,
    # `--gateway-args`); colocated, the draft's process takes the first two (its target's engine flags are its own)
    target_args: tuple[str, ...] = ()
    draft_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()

    @classmethod
    def free_ports(cls, **kwargs) -> StackConfig:
        """A config whose three ports are free right now (for a stack started on the side)."""
        gateway, draft, target = _free_ports(3)
        return replace(cls(**kwargs), gateway_port=gateway, draft_port=draft, target_port=target)

    def attention_flags(self) -> list[str]:
        """flashinfer on a GPU when it is installed (the CUDA graphs need it), else the services' default."""
        if self.device.startswith("cuda") and importlib.util.find_spec("flashinfer") is not None:
            return ["--attention-backend", "flashinfer"]
        return []

    def _lane_flags(self) -> list[str]:
        """The target's verify lane on `verify_lane_port` (0: any free port; its draft learns which from
        GetModelInfo), unless the target's own flags choose its port, or there is no draft to use it."""
        return ["--verify-lane-port", str(self.verify_lane_port)] if self._lane_from_up() else []

    def _lane_from_up(self) -> bool:
        """Whether the target process takes its lane port from `verify_lane_port`. A port named here that no target
        would take, or no draft use, is a ConfigError, not a flag dropped without a word."""
        if self.colocated:
            why = "with --colocated there is no target process"
        elif self._service_flags("target").verify_lane_port is not None:  # as the target reads it: `--verify-lane=7`
            why = "--target-args sets --verify-lane-port"
        elif self.draft_dir is None:
            why = ("with --draft none no draft would use it (to serve one for a draft started on its own: "
                   "--target-args '--verify-lane-port N')")
        else:
            return True
        if self.verify_lane_port:
            raise ConfigError(f"--verify-lane-port {self.verify_lane_port} would not be used: {why}")
        return False

    def _service_flags(self, service: str) -> argparse.Namespace:
        """The flags of `service`'s command as the service will read them; ConfigError for flags passed on in
        `--*-args` that `up` cannot start it with (`refuse_passed`)."""
        own, passed = self._argv()[service]
        given = PASSED_IN[service] if not (self.colocated and service == "draft") else "--target-args/--draft-args"
        flags = read_flags(own[0], [*own[1:], *passed], given)
        refuse_passed(service, own[0], flags, given, getattr(self, f"{service}_port"))
        return flags

    def addr(self, service: str) -> str:
        return f"{self.host}:{getattr(self, f'{service}_port')}"

    def ports(self) -> dict[str, int]:
        """The port of each service it starts. ConfigError if two share one: the second failed to bind only
        after the models had loaded."""
        ports = {name: getattr(self, f"{name}_port") for name in self.commands()}
        if self.verify_lane_port and self._lane_from_up() and "target" in ports:
            ports["verify-lane"] = self.verify_lane_port
        first = {}
        for name, port in ports.items():
            if port in first:
                raise ConfigError(f"--{first[port]}-port and --{name}-port are both {port}: each service needs a "
                                  "port of its own")
            first[port] = name
        return ports

    def commands(self) -> dict[str, list[str]]:
        """The `specdec serve-*` command line of each service, in start order. ConfigError for flags passed on
        (`--*-args`) that `up` cannot start a service with (`_service_flags`)."""
        commands = {}
        for service, (own, passed) in self._argv().items():
            self._service_flags(service)
            lane = self._lane_flags() if service == "target" else []
            commands[service] = [sys.executable, "-m", "specdec", *own, *lane, *passed]
        return commands

    def _argv(self) -> dict[str, tuple[list[str], list[str]]]:
        """Each service's `serve-*` command with the flags `up` sets itself, and the flags passed on to it
        (`--*-args`), in start order."""
        target_addr, draft_addr = self.addr("target"), self.addr("draft")
        device = ["--device", self.device, *self.attention_flags()]
        argv = {}
        if self.colocated:  # the draft's server answers for the target too
            if self.draft_dir is None:
                raise ConfigError("--colocated runs the target inside the draft's process: it needs a draft")
            target_addr = draft_addr
        else:
            argv["target"] = ([
                "serve-target", "--model", self.target_dir, *device, "--host", self.host,
                "--port", str(self.target_port),
            ], list(self.target_args))  # fmt: skip
        if self.draft_dir is not None:
            argv["draft"] = ([
                "serve-draft", "--model", self.draft_dir, "--target-model", self.target_dir,
                "--target", "in-process" if self.colocated else target_addr, *device, "--host", self.host,
                "--port", str(self.draft_port), "--speculation", self.speculation,
            ], [*(self.target_args if self.colocated else ()), *self.draft_args])  # fmt: skip
        pair = f"{draft_addr if self.draft_dir is not None else ''}={target_addr}"
        argv["gateway"] = ([
            "serve-gateway", "--model", self.target_dir, "--pair", pair,
            "--host", self.host, "--port", str(self.gateway_port),
        ], list(self.gateway_args))  # fmt: skip
        return argv


class LocalStack:
    """Owns the three processes. `log_dir` None: they write to this process's stderr; else one file each."""

    def __init__(self, config: StackConfig, log_dir: str | None = None) -> None:
        self.config = config
        self._log_dir = log_dir
        self._procs: dict[str, subprocess.Popen] = {}
        self._logs: dict[str, IO[bytes]] = {}
        self._lives: dict[str, _Life] = {}

    @property
    def gateway_addr(self) -> str:
        return self.config.addr("gateway")

    def process(self, service: str) -> subprocess.Popen:
        """The running process of "target", "draft" or "gateway"."""
        return self._procs[service]

    def addresses(self) -> dict[str, str]:
        return {name: self.config.addr(name) for name in self.config.commands()}

    def start(self, timeout_s: float = 180.0) -> None:
        """Start every service and wait until each reports SERVING; on failure stop them all and raise."""
        deadline = time.monotonic() + timeout_s
        commands = self.config.commands()
        for name, port in self.config.ports().items():  # one someone else serves on would answer health for ours
            if _answers(self.config.host, port):
                raise NotReady(f"port {port} for the {name} is already in use on {self.config.host} (another "
                               f"`specdec up`?); choose another with --{name}-port")
        try:  # the model services load side by side; the gateway starts once they serve, so it sees both up
            for name in ("target", "draft", "gateway"):
                if name == "gateway":
                    self._wait_serving(deadline - time.monotonic())
                if name in commands:
                    self._spawn(name, commands[name])
            self._wait_serving(deadline - time.monotonic())
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, command: list[str], now: float | None = None) -> None:
        with interrupts_deferred():  # recorded before an interrupt can unwind: `stop` then stops it too
            self._procs[name] = subprocess.Popen(
                command, start_new_session=True, env=child_env(), **self._output(name)
            )  # each ends itself should this process die without stopping it (`parent_watch`)
        now = time.monotonic() if now is None else now
        life = self._lives.setdefault(name, _Life(now))
        life.started, life.due = now, None

    def _output(self, name: str) -> dict:
        if self._log_dir is None:
            return {}
        if name not in self._logs:  # a restarted service appends to its log
            self._logs[name] = open(os.path.join(self._log_dir, f"{name}.log"), "wb")  # noqa: SIM115 - closed in stop()
        return {"stdout": self._logs[name], "stderr": subprocess.STDOUT}

    def _wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = dict(self._procs)
        timeout_s = max(timeout_s, 0.0)
        while waiting:
            for name in list(waiting):
                self.check_alive()
                if _is_serving(self.config.addr(name), HEALTH_NAMES[name]):
                    del waiting[name]
            if waiting and time.monotonic() > deadline:
                raise NotReady(f"not SERVING after {timeout_s:g} s: {', '.join(waiting)}{self._log_hint()}")
            if waiting:
                time.sleep(0.2)

    def check_alive(self) -> None:
        """Raise NotReady naming the first service whose process has exited."""
        for name, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                raise NotReady(f"{name} exited with status {code}{self._log_tail(name)}")

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart every service whose process has exited, once its backoff is over; returns what it did, one line
        each. Raises NotReady for a service that died `RESTARTS` times in a row within `QUICK_S` of starting."""
        now = time.monotonic() if now is None else now
        notes = []
        for name, proc in list(self._procs.items()):
            life = self._lives[name]
            if life.due is None:
                code = proc.poll()
                if code is None:
                    continue
                life.quick = life.quick + 1 if now - life.started < QUICK_S else 1
                if life.quick >= RESTARTS:
                    raise NotReady(f"{name} exited with status {code}, {life.quick} times in a row within "
                                   f"{QUICK_S:g} s of starting; giving up{self._log_tail(name)}")
                delay = min(2.0 ** (life.quick - 1), MAX_BACKOFF_S)
                life.due = now + delay
                notes.append(f"{name} exited with status {code}; restarting it in {delay:g} s")
            elif now >= life.due:
                self._spawn(name, self.config.commands()[name], now)
                notes.append(f"{name} restarted (pid {self._procs[name].pid})")
        return notes

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM in STOP_ORDER, each given `grace_s` to drain, then SIGKILL. Safe to call twice. Interrupted
        (a second Ctrl-C while a service drains), it kills whatever still runs before it lets the interrupt
        through: the services run in sessions of their own, and nothing else would stop them."""
        try:
            for name in STOP_ORDER:
                proc = self._procs.get(name)
                if proc is None or proc.poll() is not None:
                    continue
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        finally:
            running = [proc for proc in self._procs.values() if proc.poll() is None]
            for proc in running:
                proc.kill()
            for proc in running:
                proc.wait()
            self._procs.clear()
            self._lives.clear()
            for log in self._logs.values():
                log.close()
            self._logs.clear()

    def _log_tail(self, name: str, max_chars: int = 2000) -> str:
        if name not in self._logs:
            return ""
        self._logs[name].flush()
        text = Path(self._logs[name].name).read_text(errors="replace")
        return f"; last output:\n{text[-max_chars:]}"

    def _log_hint(self) -> str:
        return f" (logs in {self._log_dir})" if self._log_dir else ""

    def __enter__(self) -> LocalStack:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


@contextlib.contextmanager
def temporary_stack(config: StackConfig, timeout_s: float = 180.0):
    """A stack whose logs go to a temporary dir (shown if a service fails); stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="specdec-stack-") as log_dir:
        stack = LocalStack(config, log_dir)
        stack.start(timeout_s)
        try:
            yield stack
        finally:
            stack.stop()


def _answers(host: str, port: int) -> bool:
    """Whether something accepts connections on host:port (0.0.0.0 / :: asked on the loopback)."""
    target = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    try:
        with socket.create_connection((target, port), timeout=0.5):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def interrupts_deferred():
    """Hold back Ctrl-C, SIGTERM and SIGHUP (`STOP_SIGNALS`) until the block has run, then deliver the first one
    to the handler that was there (`specdec up` and `generate` raise KeyboardInterrupt for each). A service is
    spawned into a session of its own:
    an interrupt inside `Popen`, or before its process is recorded, lost it, and it outlived the stack holding its
    port (seen once in ~20 runs of the SIGTERM-during-start-up test on a loaded CPU). Main thread only (signal
    handlers live there); elsewhere a no-op."""
    signals = [s for s in STOP_SIGNALS if signal.getsignal(s) is not None]
    if threading.current_thread() is not threading.main_thread() or not signals:
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            signal.raise_signal(caught[0])


def is_gateway_serving(addr: str, timeout_s: float = 1.0) -> bool:
    return _is_serving(addr, HEALTH_NAMES["gateway"], timeout_s)


def _is_serving(addr: str, service: str, timeout_s: float = 1.0) -> bool:
    with grpc.insecure_channel(addr) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
