"""Every port, seconds and count flag of the services is range-checked while parsing: a value out of range stops
the command with argparse's error naming the flag (exit 2). QA: `serve-target --port 70000` listened on 4464 (the
port wrapped around), `serve-gateway --drain-seconds -1` logged `draining (up to -1 s)`."""

from __future__ import annotations

import subprocess
import sys

import pytest
from repo_paths import REPO, TINY

from specdec.cli import build_parser

# the arguments each command needs besides the flag under test
REQUIRED = {
    "serve-target": [],
    "serve-draft": ["--target-model", "T", "--target", "localhost:1"],
    "serve-gateway": ["--pair", "=localhost:1"],
    "up": [],
    "generate": ["a prompt"],
}
SERVICES = ("serve-target", "serve-draft", "serve-gateway")
MODEL_SERVICES = ("serve-target", "serve-draft")

# (command, flag, refused values, accepted values with what they parse to)
CASES = [
    *[(c, "--port", ["70000", "65536", "-1", "1.5", "abc"], {"0": 0, "65535": 65535}) for c in SERVICES],
    *[(c, "--metrics-port", ["70000", "-1"], {"0": 0, "9100": 9100}) for c in SERVICES],  # 0 = off
    *[("up", f"--{s}-port", ["0", "70000", "-1"], {"1": 1, "65535": 65535}) for s in ("gateway", "draft", "target")],
    *[(c, "--drain-seconds", ["-1", "nan", "inf"], {"0": 0.0, "2.5": 2.5}) for c in SERVICES],
    *[(c, "--max-queue-wait-seconds", ["-1", "-0.5", "nan"], {"0": 0.0, "6": 6.0}) for c in MODEL_SERVICES],
    *[(c, "--request-idle-seconds", ["-1", "nan"], {"0": 0.0, "0.5": 0.5}) for c in MODEL_SERVICES],  # 0 = never
    *[(c, "--engine-stall-seconds", ["-1", "nan", "inf", "0.5", "1e-9"], {"0": 0.0, "1": 1.0, "30": 30.0})
      for c in MODEL_SERVICES],
    ("serve-draft", "--target-wait-seconds", ["-1", "inf"], {"0": 0.0, "30": 30.0}),
    *[(c, "--simulate-accept-len", ["-1", "0.5", "nan"], {"0": 0.0, "1": 1.0, "5": 5.0}) for c in MODEL_SERVICES],
    *[(c, "--prefill-chunk-tokens", ["-1", "8", "1.5"], {"0": 0, "16": 16, "2048": 2048}) for c in MODEL_SERVICES],
    ("serve-draft", "--target", ["localhost:70000", "localhost:0", "nohost", "localhost:", ":50052",
                                 "127.0.0.1:63010:63010", "host name:1", "h:\u00b2", "a,b:1"],
     {"in-process": "in-process", "localhost:1": "localhost:1", "[::1]:50052": "[::1]:50052",
      "dns:///target.ns.svc:50052": "dns:///target.ns.svc:50052", "unix:/run/target.sock": "unix:/run/target.sock"}),
    ("generate", "--timeout", ["-1", "0", "nan"], {"0.5": 0.5, "30": 30.0}),
    ("serve-draft", "--calibration-max-batch", ["-1", "1.5"], {"0": 0, "64": 64}),
    *[(c, "--num-pages", ["-1", "1.5", "abc"], {"0": 0, "600": 600}) for c in MODEL_SERVICES],  # 0 = from memory
    *[(c, "--max-batch-size", ["0", "-1", "2.5"], {"1": 1, "64": 64}) for c in MODEL_SERVICES],
    *[(c, "--max-context", ["-1", "nan"], {"0": 0, "4096": 4096}) for c in MODEL_SERVICES],  # 0 = the model's
]


def _parse(command: str, *argv: str):
    return build_parser().parse_args([command, *REQUIRED[command], *argv])


@pytest.mark.parametrize(("command", "flag", "bad", "good"), CASES, ids=[f"{c[0]} {c[1]}" for c in CASES])
def test_out_of_range_values_are_refused_naming_the_flag(command, flag, bad, good, capsys):
    dest = flag.lstrip("-").replace("-", "_")
    for text, value in good.items():
        assert getattr(_parse(command, flag, text), dest) == value
    for text in bad:
        with pytest.raises(SystemExit) as exit_:
            _parse(command, flag, text)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}: " in err and text in err, err


def test_the_error_says_the_range_and_what_zero_means(capsys):
    for argv, said in [
        (["serve-target", "--port", "70000"],
         "argument --port: 70000 is out of range: a port 0-65535 (0 = any free port)"),
        (["serve-target", "--metrics-port", "-1"], "a port 0-65535 (0 = off)"),
        (["up", "--target-port", "0"], "argument --target-port: 0 is out of range: a port 1-65535"),
        (["serve-gateway", *REQUIRED["serve-gateway"], "--drain-seconds", "-1"], "-1 is out of range: seconds >= 0"),
        (["serve-target", "--request-idle-seconds", "-1"], "seconds >= 0 (0 = never)"),
        (["serve-target", "--max-queue-wait-seconds", "-1"], "seconds >= 0 (0 = refuse at once)"),
        (["serve-target", "--simulate-accept-len", "0.5"], "tokens per step >= 1, or 0 = off"),
        (["serve-target", "--drain-seconds", "nan"], "'nan' is not a finite number"),
        (["serve-target", "--num-pages", "-1"], "argument --num-pages: -1 is out of range: KV pages >= 0 "
                                                "(0 = size from memory)"),
        (["serve-target", "--max-batch-size", "0"], "argument --max-batch-size: 0 is out of range: requests >= 1"),
        (["serve-target", "--max-context", "-1"], "-1 is out of range: tokens >= 0 (0 = the model's)"),
    ]:
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert said in capsys.readouterr().err


def test_defaults_are_unchanged():
    target, draft = _parse("serve-target"), _parse("serve-draft")
    gateway, up = _parse("serve-gateway"), _parse("up")
    assert (target.port, target.metrics_port, target.drain_seconds, target.max_queue_wait_seconds,
            target.request_idle_seconds, target.simulate_accept_len) == (50052, 0, 30.0, 30.0, 120.0, 0.0)
    assert (draft.port, draft.target_wait_seconds, draft.request_idle_seconds) == (50051, None, None)
    assert (gateway.port, gateway.drain_seconds, gateway.metrics_port) == (50050, 30.0, 0)
    assert (up.gateway_port, up.draft_port, up.target_port) == (50050, 50051, 50052)


@pytest.mark.parametrize("argv", [
    ["serve-target", "--model", str(TINY / "target"), "--port", "70000"],
    ["serve-gateway", "--model", str(TINY / "target"), "--pair", "=127.0.0.1:62999", "--port", "70000"],
    ["serve-gateway", "--model", str(TINY / "target"), "--pair", "=127.0.0.1:62999", "--drain-seconds", "-1"],
    ["serve-target", "--model", str(TINY / "target"), "--port", "62998", "--max-queue-wait-seconds", "-1"],
])
def test_the_command_exits_2_before_it_starts(argv):
    """Through the real command line: exit 2 and argparse's one-line error, nothing served, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "specdec", *argv], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"specdec {argv[0]}: error: argument {argv[-2]}: "), proc.stderr
    assert "listening" not in proc.stderr and "Traceback" not in proc.stderr


def test_a_pairs_addresses_are_checked_like_the_drafts_target():
    """`--pair` (read when the gateway starts): a port outside 1-65535 is refused with its reason, as the draft's
    `--target` is while parsing (before, 70000 was taken and every call to that pair failed UNAVAILABLE)."""
    from gateway.config import PairAddress
    from specdec.errors import ConfigError

    assert str(PairAddress.parse("d:50051=[::1]:50052")) == "d:50051=[::1]:50052"
    for spec, said in [("d:70000=t:50052", "'d:70000': port 70000 is out of range 1-65535"),
                       ("=t:0", "'t:0': port 0 is out of range"), ("d=t:1", "'d' is not HOST:PORT"),
                       ("a:1=b:2=c:3", "'b:2=c' is not a host name"), ("A=B,C=D", "'A' is not HOST:PORT"),
                       ("=127.0.0.1:\u00b2", "is not HOST:PORT")]:
        with pytest.raises(ConfigError, match=said):
            PairAddress.parse(spec)
