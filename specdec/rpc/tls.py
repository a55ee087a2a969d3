"""TLS / mutual-TLS configuration from PEM files, and the `--tls-*` command-line flags.

The same three files mean slightly different things on each side:
- server: `cert` + `key` are the server's identity (both required); `ca`, when given, verifies client
  certificates (mutual TLS; `require_client_cert` rejects clients without one).
- client: `ca` verifies the server (absent: the system roots); `cert` + `key`, when given, are the client's
  identity for mutual TLS.

The files are checked when read (`TlsConfig.load`: each parses, the key is its certificate's), and may change
while a service runs (a renewed certificate): `specdec.rpc.tls_reload`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc

from specdec.errors import ConfigError
from specdec.rpc.tls_check import CLIENT, SERVER, check_tls_files


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

    def load(self, role: str = SERVER) -> TlsMaterial:
        """The files' contents, checked (`specdec.rpc.tls_check`) for use in `role` ("server" or "client"):
        ConfigError naming the file at fault."""
        cert, key, ca = (_read(p) if p else None for p in (self.cert, self.key, self.ca))
        names = {"cert": self.cert, "key": self.key, "ca": self.ca}
        return TlsMaterial(cert, key, ca, chains_to_ca=check_tls_files(cert, key, ca, names, role))

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials for `server.add_secure_port` that take renewed files at the next handshake."""
        from specdec.rpc.tls_reload import ServerCertificates  # (it reads TlsMaterial from here)

        if self.cert is None or self.key is None:
            raise ConfigError("a TLS server needs --tls-cert and --tls-key")
        certificates = ServerCertificates(self)
        return grpc.dynamic_ssl_server_credentials(
            certificates.initial, certificates, require_client_authentication=self.require_client_cert
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials for `grpc.aio.secure_channel` from the files as they are now."""
        return self.load(CLIENT).channel_credentials()


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes of a `TlsConfig`'s files, read at one time and checked."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None
    chains_to_ca: bool = False  # the certificate verifies against the CA bundle of its own set

    def server_configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], root_certificates=self.ca)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def handshake_hint(code: grpc.StatusCode, details: str | None, peer: str, flags: str) -> str:
    """A hint for a call that failed `UNAVAILABLE ... Socket closed`: what a TLS server's refusal looks like to a
    plaintext client, or to one without the client certificate it asks for (QA: only the server's log said why);
    "" for any other failure. `peer` names the server, `flags` the client's TLS flags."""
    if code != grpc.StatusCode.UNAVAILABLE or "Socket closed" not in (details or ""):
        return ""
    return (f" ({peer} closed the connection during its handshake: if it serves TLS, pass {flags}-ca, and "
            f"{flags}-cert/{flags}-key where it asks for a client certificate of its CA)")


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
