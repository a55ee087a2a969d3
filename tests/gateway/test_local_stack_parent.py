"""A local stack's services never outlive the process that started them. SIGHUP (a closed terminal, a dropped SSH
session) to `specdec up` stops them as Ctrl-C does; a SIGKILL to `up` or to `specdec generate` cannot be caught,
so each service watches its parent (`specdec.rpc.parent_watch`) and drains once it has gone: before, all three
were re-parented to init and kept serving, holding their ports (QA). And `up` refuses two services on one port
before it loads anything (it failed to bind only after ~20 s of loading)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest
from test_local_stack_processes import children_of, cmdline, up_process, wait_for, wait_serving

from gateway.commands import sigterm_as_interrupt
from gateway.local_stack import HEALTH_NAMES, LocalStack, StackConfig, _is_serving, interrupts_deferred
from specdec.errors import ConfigError

needs_proc = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the processes through /proc")

# A stand-in service: watches its parent as `run_cli_service` does; SIGTERM (its drain) leaves a note.
SERVICE = textwrap.dedent("""
    import os, signal, sys, time
    from specdec.rpc import parent_watch
    from specdec.rpc.parent_watch import EXIT_WITH_PARENT_ENV, exit_with_parent

    note, on_sigterm = sys.argv[1], sys.argv[2]
    def drain(signum, frame):
        open(note, "a").write("drained")
        sys.exit(0)
    if on_sigterm == "ignore":  # a drain that hangs: the watch's hard exit ends it
        parent_watch.HARD_EXIT_AFTER_S = 0.5
    signal.signal(signal.SIGTERM, drain if on_sigterm == "drain" else signal.SIG_IGN)
    exit_with_parent(0.0)
    open(note, "a").write(f"env {os.environ.get(EXIT_WITH_PARENT_ENV)};")  # its own children: no parent to watch
    time.sleep(120)
""")
# Starts the stand-in as `LocalStack` starts a service, prints its pid, and waits to be killed.
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from specdec.rpc.parent_watch import child_env

    service = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], env=child_env(),
                               start_new_session=True)
    print(service.pid, flush=True)
    time.sleep(120)
""")


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan waiting for init to reap it has no command line)."""
    return bool(cmdline(pid))


def start_orphanable(tmp_path: Path, on_sigterm: str) -> tuple[subprocess.Popen, int, Path]:
    note = tmp_path / "note"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, SERVICE, str(note), on_sigterm],
                              stdout=subprocess.PIPE, text=True)
    service = int(parent.stdout.readline())
    wait_for(lambda: note.exists(), 60, "the stand-in service watches its parent")
    return parent, service, note


@needs_proc
@pytest.mark.parametrize("on_sigterm", ["drain", "ignore"])
def test_a_service_whose_parent_is_killed_stops_itself(tmp_path, on_sigterm):
    parent, service, note = start_orphanable(tmp_path, on_sigterm)
    try:
        parent.kill()
        parent.wait(timeout=30)
        wait_for(lambda: not running(service), 15, "the orphaned service exits")
    finally:
        if running(service):
            os.kill(service, signal.SIGKILL)
    assert note.read_text() == ("env None;drained" if on_sigterm == "drain" else "env None;")


def test_sighup_is_an_interrupt_held_back_while_a_service_is_spawned():
    caught = []
    record = lambda signum, frame: caught.append(signum)  # noqa: E731 - were SIGHUP not handled: fail, not hang up
    previous = signal.signal(signal.SIGHUP, record)
    reached = False
    try:
        with sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt), interrupts_deferred():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)  # the handler would run here
            reached = True
        assert reached and not caught and signal.getsignal(signal.SIGHUP) is record
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_two_services_on_one_port_are_refused_before_anything_starts():
    cfg = StackConfig.free_ports()
    stack = LocalStack(replace(cfg, draft_port=cfg.gateway_port))
    with pytest.raises(ConfigError, match=rf"^--draft-port and --gateway-port are both {cfg.gateway_port}: "):
        stack.start(timeout_s=30)
    assert not stack._procs
    colocated = replace(cfg, colocated=True, target_port=cfg.gateway_port)  # no target process: its port unused
    assert colocated.ports() == {"draft": cfg.draft_port, "gateway": cfg.gateway_port}


def test_the_verify_lane_port_is_up_s_fourth_port():
    """`up --verify-lane-port N` puts the target's lane there (default 0: any free port), checked against the other
    ports; the target's own port flag wins over the default, and a port named that no target would take (that flag,
    or colocated: no target process) is refused rather than dropped. (TLS, which has no lane, `up` refuses:
    test_local_stack_flags.py.)"""
    cfg = StackConfig.free_ports()
    assert cfg.commands()["target"][-2:] == ["--verify-lane-port", "0"] and "verify-lane" not in cfg.ports()
    fixed = replace(cfg, verify_lane_port=cfg.target_port + 1)
    assert "--verify-lane-port" in fixed.commands()["target"] and fixed.ports()["verify-lane"] == cfg.target_port + 1
    with pytest.raises(ConfigError, match=rf"^--gateway-port and --verify-lane-port are both {cfg.gateway_port}: "):
        replace(cfg, verify_lane_port=cfg.gateway_port).ports()
    own = replace(cfg, target_args=("--verify-lane-port", "0"))
    assert own.commands()["target"].count("--verify-lane-port") == 1 and "verify-lane" not in own.ports()
    with pytest.raises(ConfigError, match="would not be used: --target-args sets --verify-lane-port$"):
        replace(fixed, target_args=("--verify-lane-port=7",)).commands()
    with pytest.raises(ConfigError, match="would not be used: with --colocated there is no target process"):
        replace(fixed, colocated=True).ports()
    assert "verify-lane" not in replace(cfg, colocated=True).ports()


def test_up_with_two_services_on_one_port_exits_at_once():
    cfg = StackConfig.free_ports()
    cmd = [sys.executable, "-m", "specdec", "up", "--gateway-port", str(cfg.gateway_port),
           "--draft-port", str(cfg.gateway_port), "--target-port", str(cfg.target_port)]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr == (f"error: --draft-port and --gateway-port are both {cfg.gateway_port}: each service "
                           "needs a port of its own\n")
    assert time.monotonic() - started < 60  # Python's start-up on a loaded CPU; the models took ~20 s more


def start_up() -> tuple[subprocess.Popen, StackConfig, list[int]]:
    """`specdec up` on free ports, once it serves; and its services' pids."""
    cfg = StackConfig.free_ports()
    up = up_process(cfg)
    try:
        wait_serving(cfg)
    except BaseException:
        stop_everything(up, children_of(up.pid))
        raise
    services = children_of(up.pid)
    assert len(services) == 3, [cmdline(pid) for pid in services]
    return up, cfg, services


def stop_everything(proc: subprocess.Popen, services: list[int]) -> list[int]:
    """Kill whatever of `proc` and `services` still runs; returns the services that did."""
    left = [pid for pid in services if "serve-" in cmdline(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)
    return left


@needs_proc
def test_sigkill_to_up_ends_its_services():
    up, cfg, services = start_up()
    try:
        up.kill()  # nothing runs in `up` any more: the services notice on their own
        up.wait(timeout=30)
        wait_for(lambda: not [pid for pid in services if "serve-" in cmdline(pid)], 60, "the services exit")
    finally:
        left = stop_everything(up, services)
    assert not left, f"{len(left)} services outlived a SIGKILLed `specdec up`"
    assert not _is_serving(cfg.addr("gateway"), HEALTH_NAMES["gateway"])


@needs_proc
def test_sighup_to_up_stops_its_services_and_up_exits():
    up, cfg, services = start_up()
    try:
        up.send_signal(signal.SIGHUP)
        _, err = up.communicate(timeout=120)
    finally:
        left = stop_everything(up, services)
    assert not left, f"{len(left)} services outlived `specdec up` after SIGHUP"
    assert up.returncode == 0, err[-3000:]
    assert "stopping" in err and "gateway stopped" in err and "parent process" not in err, err[-3000:]


@needs_proc
def test_sigkill_to_generate_ends_the_stack_it_was_starting():
    gen = subprocess.Popen([sys.executable, "-m", "specdec", "generate", "def fibonacci(n):"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    services: list[int] = []
    try:
        wait_for(lambda: len(children_of(gen.pid)) >= 2, 120, "the target and the draft are starting")
        services = children_of(gen.pid)
        gen.kill()
        gen.wait(timeout=30)
        wait_for(lambda: not [pid for pid in services if "serve-" in cmdline(pid)], 60, "the services exit")
    finally:
        left = stop_everything(gen, services)
    assert not left, f"{len(left)} services outlived a SIGKILLed `specdec generate`"
