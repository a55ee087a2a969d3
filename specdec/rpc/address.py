"""HOST:PORT addresses given on the command line (a draft's `--target`, the gateway's `--pair`): checked when they
are read, so a typo stops start-up with its reason instead of each call failing later with a vaguer error (the
gateway marked such a pair down, `Misformatted domain name`; a draft waited its 600 s for a target it could never
reach, QA)."""

from __future__ import annotations

import re

MAX_PORT = 65535
# a DNS name or IPv4 address (letters, digits, dots, dashes, underscores), or an IPv6 address in brackets
_HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.%A-Za-z]+\]")
# gRPC's own target URIs (`dns:///svc:50052` for DNS round-robin, `unix:/path` ...) are passed on as they are
URI_SCHEMES = ("dns:", "unix:", "unix-abstract:", "ipv4:", "ipv6:", "vsock:")


def address_problem(addr: str) -> str | None:
    """What is wrong with `addr` as HOST:PORT (None: nothing): a host that is no DNS name, IPv4 address or
    bracketed IPv6 address (a space, a comma list, `a:1:2`), or a port that is not 1-65535 in ASCII digits. A gRPC
    target URI (`URI_SCHEMES`) is left to gRPC."""
    if addr.startswith(URI_SCHEMES):
        return None
    host, _, port = addr.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()):
        return f"{addr!r} is not HOST:PORT"
    if not _HOST.fullmatch(host):
        return f"{addr!r}: {host!r} is not a host name, an IPv4 address or an IPv6 address in brackets"
    if not 1 <= int(port) <= MAX_PORT:
        return f"{addr!r}: port {port} is out of range 1-{MAX_PORT}"
    return None
