"""Test certificates: a CA, a server and a client certificate it signed, and a rogue self-signed one; client
credentials made from them."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc


def creds(certs, ca="ca", identity: str | None = "client") -> grpc.ChannelCredentials:
    """Client credentials from `make_certs`' files: trusting `ca`, presenting `identity` (None: no certificate)."""
    read = lambda p: p.read_bytes()  # noqa: E731
    return grpc.ssl_channel_credentials(
        root_certificates=read(certs[ca].with_suffix(".pem")),
        private_key=read(certs[identity].with_suffix(".key")) if identity else None,
        certificate_chain=read(certs[identity].with_suffix(".pem")) if identity else None,
    )


def make_certs(out: Path, expired: bool = False, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
               ca: Path | None = None) -> dict[str, Path]:
    """A test CA and, signed by it, 'server' (localhost/127.0.0.1, also usable as a client) and 'client' certs;
    plus 'rogue', a self-signed cert the CA never issued; `expired`: 'server' and 'client' expired yesterday;
    `hosts`: the names (DNS names or IP addresses) the certificates carry; `ca`: another set's CA stem path (that
    CA signs these, and is this set's CA too). Returns stem paths (add .pem / .key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def issue(cn, key, issuer, issuer_key, ca=False, days=1):
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        sans = [_san(x509, host) for host in hosts]
        builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(days=2 if days < 0 else 0, minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=days))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                   .add_extension(x509.SubjectAlternativeName(sans), critical=False))
        return builder.sign(issuer_key, hashes.SHA256()), name

    out.mkdir(parents=True, exist_ok=True)
    paths = {}

    def write(stem, cert, key):
        (out / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (out / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        paths[stem] = out / stem

    if ca is None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert, ca_name = issue("specdec test CA", ca_key, None, ca_key, ca=True)
    else:
        ca_cert = x509.load_pem_x509_certificate(ca.with_suffix(".pem").read_bytes())
        ca_key = serialization.load_pem_private_key(ca.with_suffix(".key").read_bytes(), password=None)
        ca_name = ca_cert.subject
    write("ca", ca_cert, ca_key)
    for stem in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        write(stem, issue(f"specdec {stem}", key, ca_name, ca_key, days=-1 if expired else 1)[0], key)
    rogue_key = ec.generate_private_key(ec.SECP256R1())
    write("rogue", issue("rogue", rogue_key, None, rogue_key)[0], rogue_key)
    return paths


def _san(x509, host: str):
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
