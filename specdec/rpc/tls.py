"""TLS / mutual-TLS configuration from PEM files, and the `--tls-*` command-line flags.

The same three files mean slightly different things on each side:
- server: `cert` + `key` are the server's identity (both required); `ca`, when given, verifies client
  certificates (mutual TLS; `require_client_cert` rejects clients without one).
- client: `ca` verifies the server (absent: the system roots); `cert` + `key`, when given, are the client's
  identity for mutual TLS.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc

from specdec.errors import ConfigError


@dataclass(frozen=True)
class TlsConfig:
    """Paths of PEM files; see the module docstring for what each means on the server and the client."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    require_client_cert: bool = False

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ConfigError("TLS needs both a certificate and its private key (--tls-cert and --tls-key)")
        if self.require_client_cert and self.ca is None:
            raise ConfigError("requiring client certificates needs a CA to verify them (--tls-ca)")

    @classmethod
    def from_args(cls, args: argparse.Namespace, prefix: str = "") -> TlsConfig | None:
        """The config the flags of `add_tls_args(parser, prefix)` describe; None when none was given.

        A server given `--tls-ca` requires (and verifies) client certificates.
        """
        dest = prefix.replace("-", "_")
        cert, key, ca = (getattr(args, f"{dest}tls_{name}", None) for name in ("cert", "key", "ca"))
        if cert is None and key is None and ca is None:
            return None
        return cls(cert=cert, key=key, ca=ca, require_client_cert=ca is not None and cert is not None)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for `server.add_secure_port`."""
        if self.cert is None or self.key is None:
            raise ConfigError("a TLS server needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=_read(self.ca) if self.ca else None,
            require_client_auth=self.require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for `grpc.aio.secure_channel`."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca else None,
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None,
        )


def add_tls_args(parser: argparse.ArgumentParser, prefix: str = "", who: str = "this service") -> None:
    """Add `--{prefix}tls-cert`, `--{prefix}tls-key`, `--{prefix}tls-ca` (prefix="target-" for a client)."""
    group = parser.add_argument_group(f"TLS ({who})")
    group.add_argument(f"--{prefix}tls-cert", metavar="PEM", help="certificate chain (enables TLS)")
    group.add_argument(f"--{prefix}tls-key", metavar="PEM", help=f"private key of --{prefix}tls-cert")
    group.add_argument(
        f"--{prefix}tls-ca",
        metavar="PEM",
        help="CA bundle: a server verifies and requires client certificates (mutual TLS); "
        "a client verifies the server (default: system roots)",
    )


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read TLS file {path}: {exc.strerror}") from exc
