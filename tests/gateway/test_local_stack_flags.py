"""What `specdec up` reads in the flags it passes on (`--target-args`, `--draft-args`, `--gateway-args`): each
service's own parser reads them, so an abbreviation or `--flag=value` means to `up` what it means to the service
(QA: `--target-args '--verify-lane 7'` took the lane off the port `up --verify-lane-port` had checked, and
`--tls-cer C` was not seen as TLS). TLS between the services is refused at once: `up` checks their health and wires
them to one another in plaintext, so a TLS target was never ready (QA: `up` waited out its 180 s)."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace

import pytest
from cert_factory import make_certs

from gateway.local_stack import StackConfig
from specdec.errors import ConfigError

TLS_REFUSED = r"`specdec up` connects its services to one another in plaintext .* tls\.enabled"


def test_read_flags_reads_as_the_service_s_own_command_line_does():
    from gateway.stack_flags import read_flags, tls_flags
    from specdec.cli import build_parser

    argv = ["--model", "m", "--verify-lane=7", "--tls-cer", "c.pem", "--tls-k=k.pem", "--bogus"]
    flags = read_flags("serve-target", argv, "--target-args")
    seen, unknown = build_parser().parse_known_args(["serve-target", *argv])
    assert (flags.verify_lane_port, flags.tls_cert, flags.tls_key) == (7, "c.pem", "k.pem") == \
        (seen.verify_lane_port, seen.tls_cert, seen.tls_key)
    assert unknown == ["--bogus"] and tls_flags("serve-target", flags) == ["--tls-cert", "--tls-key"]


@pytest.mark.parametrize("target_args", [
    ("--tls-cert", "c.pem", "--tls-key", "k.pem"),
    ("--tls-cer=c.pem", "--tls-ke=k.pem"),  # abbreviated, as the target's argparse takes them
])
def test_tls_between_the_services_is_refused_before_anything_starts(target_args):
    cfg = StackConfig.free_ports()
    with pytest.raises(ConfigError, match=rf"^--target-args sets --tls-cert: {TLS_REFUSED}"):
        replace(cfg, target_args=target_args).commands()
    with pytest.raises(ConfigError, match=rf"^--draft-args sets --target-tls-ca: {TLS_REFUSED}"):
        replace(cfg, draft_args=("--target-tls-ca", "ca.pem")).commands()
    with pytest.raises(ConfigError, match=rf"^--gateway-args sets --tls-cert: {TLS_REFUSED}"):
        replace(cfg, gateway_args=("--tls-cert=c.pem", "--tls-key=k.pem")).ports()
    with pytest.raises(ConfigError, match=rf"^--target-args/--draft-args sets --tls-cert: {TLS_REFUSED}"):
        replace(cfg, colocated=True, target_args=target_args).commands()  # the draft's process takes them


def test_up_with_a_tls_target_exits_at_once(tmp_path):
    server = make_certs(tmp_path)["server"]  # a target that would serve: before, `up` waited on it in plaintext
    cfg = StackConfig.free_ports()
    cmd = [sys.executable, "-m", "specdec", "up", "--gateway-port", str(cfg.gateway_port), "--draft-port",
           str(cfg.draft_port), "--target-port", str(cfg.target_port),
           "--target-args", f"--tls-cert {server}.pem --tls-key {server}.key"]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.startswith("error: --target-args sets --tls-cert: "), done.stderr
    assert time.monotonic() - started < 60  # Python's start-up on a loaded CPU; before, up waited 180 s


@pytest.mark.parametrize("own", [("--verify-lane", "7"), ("--verify-lane=7",), ("--verify-lane-port=7",)])
def test_the_target_s_own_lane_port_is_seen_in_any_form_its_parser_takes(own):
    cfg = StackConfig.free_ports()
    target = replace(cfg, target_args=own).commands()["target"]
    assert target.count("--verify-lane-port") == own.count("--verify-lane-port")  # up adds none of its own
    with pytest.raises(ConfigError, match=r"^--verify-lane-port \d+ would not be used: --target-args sets "
                                          r"--verify-lane-port$"):
        replace(cfg, verify_lane_port=cfg.target_port + 1, target_args=own).ports()


def test_flags_the_target_would_refuse_are_refused_naming_where_they_came_from():
    cfg = StackConfig.free_ports()
    with pytest.raises(ConfigError, match=r"^--target-args: specdec serve-target would refuse its flags: ambiguous "
                                          r"option: --tls-c could match --tls-cert, --tls-ca$"):
        replace(cfg, target_args=("--tls-c", "x.pem")).commands()
    with pytest.raises(ConfigError, match=r"^--target-args sets --port 9: `specdec up` gives the target its port; "
                                          r"use `specdec up --target-port`$"):
        replace(cfg, target_args=("--por", "9")).commands()  # up would have waited on --target-port
    assert replace(cfg, target_args=("--bogus",)).commands()["target"][-1] == "--bogus"  # the target's to refuse


def test_a_lane_port_without_a_draft_is_refused_and_none_is_opened():
    """`up --draft none`: no draft asks the target for its lane. A port named for it is refused; by default the
    target gets no lane; a target's own `--verify-lane-port` (a draft started on its own) still goes through."""
    cfg = replace(StackConfig.free_ports(), draft_dir=None)
    assert "--verify-lane-port" not in cfg.commands()["target"] and "verify-lane" not in cfg.ports()
    with pytest.raises(ConfigError, match=r"^--verify-lane-port \d+ would not be used: with --draft none no draft "
                                          r"would use it \(to serve one for a draft started on its own: "
                                          r"--target-args '--verify-lane-port N'\)$"):
        replace(cfg, verify_lane_port=cfg.target_port + 1).ports()
    own = replace(cfg, target_args=("--verify-lane-port", "0")).commands()["target"]
    assert own[-2:] == ["--verify-lane-port", "0"] and own.count("--verify-lane-port") == 1


def test_up_with_a_lane_port_and_no_draft_exits_at_once():
    cfg = StackConfig.free_ports()
    lane = cfg.draft_port  # free: no draft
    cmd = [sys.executable, "-m", "specdec", "up", "--draft", "none", "--verify-lane-port", str(lane),
           "--gateway-port", str(cfg.gateway_port), "--target-port", str(cfg.target_port)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.startswith(f"error: --verify-lane-port {lane} would not be used: "
                                                           "with --draft none"), done.stderr
