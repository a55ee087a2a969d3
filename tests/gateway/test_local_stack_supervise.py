"""`LocalStack.supervise` (what `specdec up` runs): a service whose process exits is started again after a
backoff, and one that keeps dying right after each start is given up on. Stand-in commands, no services."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, replace

import pytest

from gateway import local_stack
from gateway.local_stack import LocalStack, StackConfig
from specdec.errors import NotReady

EXIT_3 = [sys.executable, "-c", "raise SystemExit(3)"]
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


@dataclass(frozen=True)
class Scripted(StackConfig):
    """A stack whose "draft" runs `command` (a stand-in for `specdec serve-draft`)."""

    command: tuple[str, ...] = tuple(SLEEP)

    def commands(self) -> dict[str, list[str]]:
        return {"draft": list(self.command)}


def dead(stack: LocalStack, name: str) -> None:
    stack.process(name).wait(timeout=30)


def test_a_service_that_exits_is_started_again_after_its_backoff():
    stack = LocalStack(Scripted())
    try:
        stack._spawn("draft", EXIT_3, now=0.0)
        dead(stack, "draft")
        assert stack.supervise(now=1.0) == ["draft exited with status 3; restarting it in 1 s"]
        assert stack.supervise(now=1.5) == []  # still backing off
        (note,) = stack.supervise(now=2.1)
        assert note.startswith("draft restarted (pid ")
        assert stack.process("draft").poll() is None  # the config's command runs again
        assert stack.supervise(now=3.0) == []
    finally:
        stack.stop(grace_s=5)


def test_backoff_doubles_and_a_service_dying_right_after_each_start_is_given_up():
    stack = LocalStack(Scripted(command=tuple(EXIT_3)))
    now, delays = 0.0, []
    try:
        stack._spawn("draft", EXIT_3, now=now)
        with pytest.raises(NotReady, match="draft exited with status 3, 5 times in a row within 60 s"):
            for _ in range(10):
                dead(stack, "draft")
                now += 0.1
                (note,) = stack.supervise(now=now)
                delays.append(float(note.split("restarting it in ")[1].split(" s")[0]))
                now = stack._lives["draft"].due
                assert stack.supervise(now=now)[0].startswith("draft restarted")
        assert delays == [1, 2, 4, 8]
    finally:
        stack.stop(grace_s=5)


def test_a_death_after_a_long_run_starts_the_count_again():
    stack = LocalStack(Scripted())
    try:
        stack._spawn("draft", EXIT_3, now=0.0)
        stack._lives["draft"].quick = 3  # it had died quickly before
        dead(stack, "draft")
        assert stack.supervise(now=local_stack.QUICK_S + 10) == ["draft exited with status 3; restarting it in 1 s"]
        assert stack._lives["draft"].quick == 1
    finally:
        stack.stop(grace_s=5)


def test_a_second_interrupt_while_stopping_kills_what_still_runs(tmp_path):
    """Ctrl-C twice: the first stops the stack, the second comes while a service drains; none is left running
    (they run in sessions of their own: nothing else would stop them)."""
    import _thread
    import threading

    deaf = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)"]
    stack = LocalStack(Scripted(), str(tmp_path))
    stack._spawn("gateway", deaf)
    stack._spawn("draft", deaf)
    procs = [stack.process("gateway"), stack.process("draft")]
    for name in ("gateway", "draft"):  # SIGTERM ignored from here on
        log = tmp_path / f"{name}.log"
        while "ready" not in log.read_text():
            time.sleep(0.05)
    # `interrupt_main` runs whatever SIGINT handler is installed: Python's own here, not one an earlier test's
    # event loop may have left (the full suite once saw no KeyboardInterrupt, CI run beside other work)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(1.0, _thread.interrupt_main).start()  # while `stop` waits out the gateway's grace period
        with pytest.raises(KeyboardInterrupt):
            stack.stop(grace_s=30)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert all(proc.poll() is not None for proc in procs)


def test_sigterm_while_a_service_is_spawned_stops_it_too(monkeypatch, tmp_path):
    """`specdec generate` turns SIGTERM into KeyboardInterrupt; one arriving inside `Popen` (the service already
    started in a session of its own) comes after the process is recorded, so `stop` stops it: before, the
    interrupt lost it and it outlived the stack (the process test `test_sigterm_to_generate_stops_the_stack_it_started`
    saw that once on a loaded CPU)."""
    import os
    import signal

    from gateway.commands import sigterm_as_interrupt

    real_popen = local_stack.subprocess.Popen

    def popen_then_sigterm(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)  # as if it came while Popen returned
        time.sleep(0.05)  # the handler would run here
        return proc

    monkeypatch.setattr(local_stack.subprocess, "Popen", popen_then_sigterm)
    stack = LocalStack(Scripted(), str(tmp_path))
    before = signal.getsignal(signal.SIGTERM)
    with sigterm_as_interrupt(), pytest.raises(KeyboardInterrupt):
        try:
            stack._spawn("draft", SLEEP)
        except KeyboardInterrupt:
            proc = stack.process("draft")  # recorded
            stack.stop(grace_s=5)
            raise
    assert proc.poll() is not None
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_port_already_served_fails_the_start_before_anything_is_spawned():
    """`specdec up --gateway-port P` with another gateway on P: its own gateway could not bind, yet P's health
    check answered for it, so `up` printed "ready" and then crash-looped (QA). Now it stops at once, naming the
    port, and starts nothing."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    busy = listener.getsockname()[1]
    try:
        config = replace(StackConfig.free_ports(), gateway_port=busy)
        stack = LocalStack(config)
        started = time.monotonic()
        with pytest.raises(NotReady, match=rf"port {busy} for the gateway is already in use"):
            stack.start(timeout_s=30)
        assert time.monotonic() - started < 5 and not stack._procs
    finally:
        listener.close()


def test_stopping_gives_each_service_longer_than_its_drain():
    """Ctrl-C on `specdec up` let the gateway drain for 15 s of its 30 and then killed it (QA: streams cut with
    UNAVAILABLE, no `gateway stopped` line)."""
    import inspect

    assert inspect.signature(LocalStack.stop).parameters["grace_s"].default > 30.0


def test_a_colocated_stack_has_no_target_process_and_needs_a_draft():
    from specdec.errors import ConfigError

    cfg = StackConfig(colocated=True)
    commands = cfg.commands()
    assert list(commands) == ["draft", "gateway"]
    draft = commands["draft"]
    assert draft[draft.index("--target") + 1] == "in-process"
    gateway = commands["gateway"]
    assert gateway[gateway.index("--pair") + 1] == f"{cfg.addr('draft')}={cfg.addr('draft')}"
    with pytest.raises(ConfigError, match="needs a draft"):
        StackConfig(colocated=True, draft_dir=None).commands()


def test_up_passes_more_flags_to_the_service_that_takes_them():
    """`specdec up --target-args/--draft-args`: each string split as a shell would, appended to its service's command
    (so an engine flag `up` has no option of its own, such as --engine-stall-seconds, can still be set); colocated,
    the draft's process, which runs the target, takes both."""
    from specdec.cli import build_parser

    args = build_parser().parse_args(["up", "--target-args", "--engine-stall-seconds 60 --prefill-chunk-tokens 0",
                                      "--draft-args", "--max-batch-size 8"])
    assert args.target_args == ["--engine-stall-seconds", "60", "--prefill-chunk-tokens", "0"]
    cfg = StackConfig(target_args=tuple(args.target_args), draft_args=tuple(args.draft_args))
    commands = cfg.commands()
    assert commands["target"][-4:] == args.target_args and "--engine-stall-seconds" not in commands["draft"]
    assert commands["draft"][-2:] == ["--max-batch-size", "8"]
    colocated = StackConfig(colocated=True, target_args=("--prefill-chunk-tokens", "0"),
                            draft_args=("--max-batch-size", "8")).commands()["draft"]
    assert colocated[-4:] == ["--prefill-chunk-tokens", "0", "--max-batch-size", "8"]
    # the gateway's too (QA: `up` had no way to give it a metrics port)
    args = build_parser().parse_args(["up", "--gateway-args", "--metrics-port 9100"])
    gateway = StackConfig(gateway_args=tuple(args.gateway_args)).commands()["gateway"]
    assert gateway[-2:] == ["--metrics-port", "9100"]
    assert "--metrics-port" not in StackConfig(gateway_args=tuple(args.gateway_args)).commands()["target"]


def test_up_takes_a_single_flag_as_more_flags():
    """A value that is one flag (`--target-args '--disable-cuda-graph'`) read as an option of its own to argparse:
    `expected one argument` (QA). `specdec up` attaches it to its option; other commands' arguments are left alone."""
    from specdec.cli import attach_flag_values, build_parser

    argv = ["up", "--target-args", "--disable-cuda-graph", "--draft-args", "--speculation off", "--device", "cpu"]
    args = build_parser().parse_args(attach_flag_values(argv))
    assert args.target_args == ["--disable-cuda-graph"] and args.draft_args == ["--speculation", "off"]
    assert args.device == "cpu"
    same = ["generate", "--stop", "--target-args", "x"]
    assert attach_flag_values(same) == same


def test_an_unknown_flag_is_refused_by_its_subcommand(capsys):
    """With the subcommand's usage and name (it printed the top level's `usage: specdec [-h] COMMAND ...`, QA)."""
    import pytest

    from specdec.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--bogus", "x"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "usage: specdec generate" in err
    assert "specdec generate: error: unrecognized arguments: --bogus" in err


def test_the_bundled_models_are_found_wherever_the_package_is_installed(tmp_path, monkeypatch):
    """Beside the package in a checkout; `$SPECDEC_BUNDLED_MODELS` first where set (a plain `pip install .` puts the
    package in site-packages, away from the models: QA)."""
    from gateway.local_stack import BUNDLED_MODELS_ENV, REPO_ROOT, bundled_models

    monkeypatch.delenv(BUNDLED_MODELS_ENV, raising=False)
    assert bundled_models() == REPO_ROOT / "models" / "tiny-code" and (bundled_models() / "target").is_dir()
    monkeypatch.setenv(BUNDLED_MODELS_ENV, str(tmp_path))
    assert bundled_models() == tmp_path
    monkeypatch.setenv(BUNDLED_MODELS_ENV, str(tmp_path / "missing"))
    assert bundled_models() == REPO_ROOT / "models" / "tiny-code"
