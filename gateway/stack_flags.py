"""The flags `specdec up` passes on to a service (`--target-args`, `--draft-args`, `--gateway-args`), read as that
service will read them: by its own argparse parser, so an abbreviation (`--verify-lane 7`, `--tls-cer C`), the
`--flag=value` form and the last of a flag given twice mean to `up` what they mean to the service.

    flags = read_flags("serve-target", ["--model", "m", "--verify-lane=7"], "--target-args")
    flags.verify_lane_port  ->  7

Flags the service does not know are left to it (it refuses them at start-up with its usage); a flag it would refuse
otherwise (an ambiguous abbreviation, a bad value) is a ConfigError here, naming `up`'s option that carried it, and
so are flags `up` cannot start a service with (`refuse_passed`: TLS, another port).
"""

from __future__ import annotations

import argparse
import functools
import importlib

from specdec.errors import ConfigError

# the module that registers each service's subcommand (`specdec.cli.COMMAND_MODULES`)
SERVICE_MODULES = {
    "serve-target": "target_service.cli",
    "serve-draft": "draft_service.cli",
    "serve-gateway": "gateway.cli",
}
# what switches TLS on in a service, as argparse dests: its own server side, and the draft's side towards its target
TLS_DESTS = ("tls_cert", "tls_key", "tls_ca", "target_tls_cert", "target_tls_key", "target_tls_ca")


class _RaisingParser(argparse.ArgumentParser):
    """A parser whose errors raise instead of printing usage and exiting (its subparsers are of its class too)."""

    def error(self, message: str):
        raise argparse.ArgumentError(None, message)


@functools.cache
def service_parser(command: str) -> argparse.ArgumentParser:
    """The parser `specdec COMMAND` reads its flags with (`command`: a key of SERVICE_MODULES)."""
    subparsers = _RaisingParser(prog="specdec").add_subparsers()
    importlib.import_module(SERVICE_MODULES[command]).register(subparsers)
    return subparsers.choices[command]


def read_flags(command: str, argv: list[str], given_in: str) -> argparse.Namespace:
    """`argv` (the flags after `specdec COMMAND`) as the service reads them; unknown flags left out."""
    try:
        flags, _unknown = service_parser(command).parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise ConfigError(f"{given_in}: specdec {command} would refuse its flags: {exc}") from None
    return flags


def option_name(command: str, dest: str) -> str:
    """The long option of `dest` in `specdec COMMAND` (`tls_cert` -> `--tls-cert`), whatever form was given."""
    action = next(a for a in service_parser(command)._actions if a.dest == dest)
    return max(action.option_strings, key=len)


def tls_flags(command: str, flags: argparse.Namespace) -> list[str]:
    """The TLS flags `flags` sets, by their full names."""
    return [option_name(command, d) for d in TLS_DESTS if getattr(flags, d, None) is not None]


def refuse_passed(service: str, command: str, flags: argparse.Namespace, given: str, port: int) -> None:
    """ConfigError for what `up` cannot start `service` with: TLS (`up` checks health and wires the services to one
    another in plaintext, so it would never be ready), or a port other than `port`, the one `up` waits on."""
    tls = tls_flags(command, flags)
    if tls:
        raise ConfigError(
            f"{given} sets {tls[0]}: `specdec up` connects its services to one another in plaintext (its own health "
            f"checks too), so a {service} with TLS would never be ready. For TLS between the services start each "
            "with `specdec serve-*` and its --tls-* flags (a draft's towards its target: --target-tls-*), or use the "
            "Helm chart's tls.enabled (docs/deploy.md)")
    if flags.port != port:
        raise ConfigError(f"{given} sets --port {flags.port}: `specdec up` gives the {service} its port; use "
                          f"`specdec up --{service}-port`")
