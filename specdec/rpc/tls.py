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
import ssl
import tempfile
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

    def load(self) -> TlsMaterial:
        """The files' contents, checked: each parses as PEM, the key is the certificate's (ConfigError naming the
        files otherwise: grpc would only fail every handshake, with nothing in the service's log)."""
        material = TlsMaterial(
            cert=_read(self.cert) if self.cert else None,
            key=_read(self.key) if self.key else None,
            ca=_read(self.ca) if self.ca else None,
        )
        try:
            material.check()
        except ConfigError as exc:
            raise ConfigError(f"TLS files {', '.join(p for p in (self.cert, self.key, self.ca) if p)}: {exc}") from None
        return material

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
        return self.load().channel_credentials()


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes of a `TlsConfig`'s files, read at one time."""

    cert: bytes | None
    key: bytes | None
    ca: bytes | None

    def check(self) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if self.ca is not None:
            try:
                context.load_verify_locations(cadata=self.ca.decode("ascii", errors="replace"))
            except (ssl.SSLError, ValueError) as exc:
                raise ConfigError(f"the CA bundle holds no PEM certificate ({exc})") from None
        if self.cert is None or self.key is None:
            return
        with tempfile.TemporaryDirectory(prefix="specdec-tls-") as tmp:  # ssl loads a chain from files only
            cert, key = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
            cert.write_bytes(self.cert)
            key.touch(mode=0o600)
            key.write_bytes(self.key)
            try:
                context.load_cert_chain(cert, key, password=_no_password)
            except ssl.SSLError as exc:
                raise ConfigError(_why_not_loaded(exc)) from None

    def server_configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(self.key, self.cert)], root_certificates=self.ca)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def _why_not_loaded(exc: ssl.SSLError) -> str:
    if "KEY_VALUES_MISMATCH" in str(exc):
        return "the private key is not the certificate's"
    if "PEM lib" in str(exc):
        return "the certificate chain and the (unencrypted) private key must each be PEM"
    return f"the certificate and key do not load ({exc})"


def _no_password() -> bytes:
    return b""  # an encrypted key (which grpc cannot use either) fails to load instead of prompting on a terminal


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
