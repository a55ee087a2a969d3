"""HOST:PORT addresses given on the command line (a draft's `--target`, the gateway's `--pair`): checked when they
are read, so a typo stops start-up with its reason instead of each call failing later with a vaguer error."""

from __future__ import annotations

MAX_PORT = 65535


def address_problem(addr: str) -> str | None:
    """What is wrong with `addr` as HOST:PORT (None: nothing): no host, no port, or a port outside 1-65535 (a
    channel to port 70000 is created without complaint and every call on it fails UNAVAILABLE)."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        return f"{addr!r} is not HOST:PORT"
    if not 1 <= int(port) <= MAX_PORT:
        return f"{addr!r}: port {port} is out of range 1-{MAX_PORT}"
    return None
