"""The local stacks' processes. `specdec up` keeps the stack running when a service dies: the draft is killed,
the gateway goes on serving (its target decodes plainly), `up` starts the draft again and speculation resumes.
SIGTERM to `up`, or to a `specdec generate` that started a stack of its own, stops the services too (by default
it ended that process alone and left them running, holding their ports). Real services on CPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.client import GatewayClient
from gateway.local_stack import HEALTH_NAMES, StackConfig, _is_serving


def cmdline(pid: int | str) -> str:
    """A process's command line, arguments joined by spaces ("" once it is gone; Linux /proc)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pids_running(fragment: str) -> list[int]:
    """Processes whose command line contains `fragment`."""
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and fragment in cmdline(e.name)]


def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.2)


def up_process(cfg: StackConfig) -> subprocess.Popen:
    """`specdec up` on `cfg`'s ports, started (wait for it to serve with `wait_serving`)."""
    cmd = [sys.executable, "-m", "specdec", "up", "--gateway-port", str(cfg.gateway_port),
           "--draft-port", str(cfg.draft_port), "--target-port", str(cfg.target_port)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_serving(cfg: StackConfig) -> None:
    wait_for(lambda: _is_serving(cfg.addr("gateway"), HEALTH_NAMES["gateway"]), 240, "the stack serves")


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the draft's process through /proc")
def test_up_restarts_a_killed_draft_and_the_gateway_serves_throughout():
    cfg = StackConfig.free_ports()
    up = up_process(cfg)
    try:
        wait_serving(cfg)
        fragment = f"serve-draft --model {cfg.draft_dir}"
        (draft,) = [p for p in pids_running(fragment) if f"--port {cfg.draft_port}" in cmdline(p)]
        with GatewayClient(cfg.addr("gateway"), timeout_s=60) as client:
            before, stats = client.complete("def fibonacci(n):", max_new_tokens=16)
            assert stats.speculative
            os.kill(draft, signal.SIGKILL)
            during, stats = client.complete("def fibonacci(n):", max_new_tokens=16)  # the target serves it
            assert during == before and up.poll() is None
            wait_for(lambda: _is_serving(cfg.addr("draft"), HEALTH_NAMES["draft"]), 120, "the draft is back")
            assert draft not in pids_running(fragment)

            def speculating() -> bool:
                text, st = client.complete("def fibonacci(n):", max_new_tokens=16)
                assert text == before
                return st.speculative

            wait_for(speculating, 30, "the gateway routes to the restarted draft again")
    finally:
        up.terminate()  # SIGTERM, as `kill` or a process manager sends it
        ports = (cfg.gateway_port, cfg.draft_port, cfg.target_port)
        try:
            _, err = up.communicate(timeout=90)
        except subprocess.TimeoutExpired:  # `up`, or services it left behind, still hold its pipes
            err = ""
        left = [pid for port in ports for pid in pids_running(f"--port {port}")]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
        if not err:
            _, err = up.communicate(timeout=30)
    assert not left, f"{len(left)} services outlived `specdec up`"
    assert up.returncode == 0, err[-3000:]
    assert "specdec up: draft exited with status -9; restarting it in 1 s" in err, err[-3000:]
    assert "specdec up: draft restarted (pid " in err


def children_of(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the services' processes through /proc")
def test_sigterm_to_generate_stops_the_stack_it_started():
    """`specdec generate` with no gateway running starts its own stack; SIGTERM while it comes up stops it."""
    gen = subprocess.Popen([sys.executable, "-m", "specdec", "generate", "def fibonacci(n):"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(children_of(gen.pid)) >= 2, 120, "the target and the draft are starting")
        services = children_of(gen.pid)
        gen.terminate()
        _, err = gen.communicate(timeout=90)
    finally:
        if gen.poll() is None:
            gen.kill()
            gen.communicate()
    left = [pid for pid in services if "serve-" in cmdline(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} services outlived `specdec generate`"
    assert gen.returncode == 130 and "interrupted" in err, err[-3000:]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the services' processes through /proc")
def test_up_colocated_runs_two_processes_and_serves_both_paths():
    """`specdec up --colocated`: the draft runs the target in its own process (no serve-target), the gateway's pair
    names the draft's port for both parts: speculative and `no_speculation` requests give the same greedy text."""
    cfg = StackConfig.free_ports()
    cmd = [sys.executable, "-m", "specdec", "up", "--colocated", "--gateway-port", str(cfg.gateway_port),
           "--draft-port", str(cfg.draft_port), "--target-port", str(cfg.target_port)]
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_for(lambda: _is_serving(cfg.addr("gateway"), HEALTH_NAMES["gateway"]), 240, "the stack serves")
        services = [cmdline(pid) for pid in children_of(up.pid)]
        assert len(services) == 2 and not [c for c in services if "serve-target" in c], services
        assert [c for c in services if "serve-draft" in c and "--target in-process" in c], services
        with GatewayClient(cfg.addr("gateway"), timeout_s=60) as client:
            spec, stats = client.complete("def fibonacci(n):", max_new_tokens=24)
            plain, plain_stats = client.complete("def fibonacci(n):", max_new_tokens=24, no_speculation=True)
        assert stats.speculative and not plain_stats.speculative and spec == plain
    finally:
        up.terminate()
        try:
            out, err = up.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            out, err = up.communicate(timeout=30)
    assert up.returncode == 0, err[-3000:]
    assert not pids_running(f"--port {cfg.draft_port}")
