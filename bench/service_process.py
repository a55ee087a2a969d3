"""A specdec service as its own process (`python -m specdec serve-...`), as deployed, with its Prometheus metrics
scraped: the benchmarks read where its steps go from `specdec:step_phase_seconds` instead of wrapping its code.

    proc = ServiceProcess(["serve-target", "--model", "models/tiny-code/target"], "specdec.v1.TargetService")
    before = proc.scrape()
    ...
    after = proc.scrape()
    forward_s = after.phase_sum("forward") - before.phase_sum("forward")
    proc.stop()

`SPECDEC_BENCH_PROFILE=DIR`: each service runs under cProfile (its main thread: the event loop;
`bench/profiled_service.py`) and writes `DIR/<serve-command>-<port>.prof` when stopped.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
_SAMPLE = re.compile(r"^(specdec:[a-z_]+)(\{[^}]*\})? (\S+)$", re.M)
_PHASE = re.compile(r'phase="([a-z_]+)"')


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Scrape:
    """One scrape of a service's /metrics: {(name, phase or ""): summed value}."""

    values: dict[tuple[str, str], float]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        values: dict[tuple[str, str], float] = {}
        for name, labels, value in _SAMPLE.findall(text):
            phase = _PHASE.search(labels or "")
            key = (name, phase.group(1) if phase else "")
            values[key] = values.get(key, 0.0) + float(value)
        return cls(values)

    def get(self, name: str) -> float:
        return self.values.get((name, ""), 0.0)

    def phase_sum(self, phase: str) -> float:
        return self.values.get(("specdec:step_phase_seconds_sum", phase), 0.0)

    def phase_count(self, phase: str) -> float:
        return self.values.get(("specdec:step_phase_seconds_count", phase), 0.0)


class ServiceProcess:
    """Starts `python -m specdec <argv> --port P --metrics-port M` and waits until its health service says
    SERVING (fails fast if the process dies while loading)."""

    def __init__(self, argv: list[str], health_name: str, timeout_s: float = 900.0):
        from specdec.rpc.channel import make_channel, wait_for_serving

        port, self.metrics_port = free_port(), free_port()
        self.addr = f"127.0.0.1:{port}"
        command = argv[0]
        profile = os.environ.get("SPECDEC_BENCH_PROFILE")
        runner = ([str(REPO_ROOT / "bench" / "profiled_service.py"), f"{profile}/{command}-{port}.prof"] if profile
                  else ["-m", "specdec"])
        argv = [sys.executable, *runner, *argv, "--port", str(port), "--metrics-port",
                str(self.metrics_port)]
        path = os.pathsep.join(x for x in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if x)
        self.proc = subprocess.Popen(argv, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": path})

        async def ready():
            async with make_channel(self.addr) as channel:
                deadline = time.monotonic() + timeout_s
                while True:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"{command} exited with {self.proc.returncode}")
                    try:
                        return await wait_for_serving(channel, health_name, 5.0)
                    except Exception:
                        if time.monotonic() > deadline:
                            raise

        try:
            asyncio.run(ready())
        except BaseException:
            self.stop()
            raise

    def scrape(self) -> Scrape:
        return Scrape.parse(self.metrics_text())

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as reply:
            return reply.read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
