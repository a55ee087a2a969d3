"""What a set of TLS files must be before a service uses it, checked with Python's own `ssl` (no extra package):
each file parses, the key is its certificate's, the certificate is within its validity period, and whether it
chains to the set's own CA bundle. grpc takes any bytes and then fails every handshake, with nothing in the
service's log; a renewal that went wrong (an expired certificate, a CA swapped before its certificates) cut every
new connection (QA).

The certificate is tried in a TLS handshake in memory, in the role the service gives it: a server's as a server's
(its clients verify it), a client's as a client's (its server verifies it; a certificate whose extended key usage
forbids the role fails there too). It is verified against the set's CA bundle when it chains to it, else against
itself (OpenSSL's partial chains): only its dates and purpose, since a public CA may have signed it.
"""

from __future__ import annotations

import re
import ssl
import tempfile
from pathlib import Path

from specdec.errors import ConfigError

SERVER, CLIENT = "server", "client"
_CERT_BLOCK = re.compile(rb"-----BEGIN CERTIFICATE-----[A-Za-z0-9+/=\s]*?-----END CERTIFICATE-----")


def check_tls_files(cert: bytes | None, key: bytes | None, ca: bytes | None, names: dict[str, str],
                    role: str) -> bool:
    """ConfigError naming the file at fault; else whether the certificate chains to the CA bundle (False when
    either is absent). `names`: "cert", "key", "ca" -> the file's path (for messages)."""
    if ca is not None:
        _anchors(ca, f"the CA bundle {names.get('ca')}")
    if cert is None or key is None:
        return False
    _anchors(cert, f"the certificate file {names.get('cert')}")
    with tempfile.TemporaryDirectory(prefix="specdec-tls-") as tmp:  # ssl loads a chain from files only
        cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert_path.write_bytes(cert)
        key_path.touch(mode=0o600)
        key_path.write_bytes(key)
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_path, key_path, password=_no_password)
        except ssl.SSLError as exc:
            why = ("is not the certificate's private key" if "KEY_VALUES_MISMATCH" in str(exc)
                   else "is not an unencrypted PEM private key")
            raise ConfigError(f"the key file {names.get('key')} {why}") from None
        if ca is not None and _handshake(cert_path, key_path, _certificate_blocks(ca), role, False) is None:
            return True  # verified against the bundle: chain, dates and purpose
        why = _handshake(cert_path, key_path, _certificate_blocks(cert), role, partial=True)
        if why:
            raise ConfigError(f"the certificate {names.get('cert')} cannot be used as a {role}'s: {why}")
        return False


def certificate_names(pem: bytes) -> frozenset[str] | None:
    """The host names and IP addresses the (first) certificate of `pem` is valid for: its subject alternative
    names, or its common name when it has none (what a client's hostname check reads). None when this Python
    cannot say (the decoder is CPython's, not a documented API)."""
    decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
    if decode is None:
        return None
    with tempfile.TemporaryDirectory(prefix="specdec-tls-") as tmp:
        path = Path(tmp, "cert.pem")
        path.write_bytes(pem)
        try:
            info = decode(str(path))
        except (ssl.SSLError, OSError, ValueError):
            return None
    names = frozenset(value for kind, value in info.get("subjectAltName", ()) if kind in ("DNS", "IP Address"))
    if names:
        return names
    return frozenset(value for rdn in info.get("subject", ()) for key, value in rdn if key == "commonName")


def covers(names: frozenset[str], name: str) -> bool:
    """Whether a certificate for `names` is valid for `name` (a wildcard covers one leftmost label)."""
    if name in names:
        return True
    head, _, rest = name.partition(".")
    return bool(head and rest and not name.startswith("*") and f"*.{rest}" in names)


def _anchors(pem: bytes, what: str) -> None:
    blocks = _certificate_blocks(pem)
    if not blocks:
        raise ConfigError(f"{what} does not load as PEM certificates (no -----BEGIN CERTIFICATE----- block)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cadata=blocks)
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{what} does not load as PEM certificates ({exc})") from None


def _certificate_blocks(pem: bytes) -> str:
    """The PEM certificate blocks of `pem` as the ASCII text `cadata` takes: the text around them, which OpenSSL
    and grpc skip, may be in any encoding (QA: a UTF-8 comment line, or a DER file, failed start-up with a
    TypeError traceback: `cadata should be an ASCII string`)."""
    return "\n".join(m.group().decode("ascii") for m in _CERT_BLOCK.finditer(pem))


def _handshake(cert_path: Path, key_path: Path, anchors: str, role: str, partial: bool) -> str | None:
    """Why a handshake in memory fails with this certificate in `role`, verified against `anchors`; None if not."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False
    server.load_cert_chain(cert_path, key_path, password=_no_password)
    verifier = client if role == SERVER else server
    if role == CLIENT:
        client.load_cert_chain(cert_path, key_path, password=_no_password)
        client.verify_mode = ssl.CERT_NONE
        server.verify_mode = ssl.CERT_REQUIRED
    verifier.load_verify_locations(cadata=anchors)
    if partial:
        verifier.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_side=False)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {c: False, s: False}
    for _ in range(20):
        for end, out, peer_in in ((c, c_out, s_in), (s, s_out, c_in)):
            if not done[end]:
                try:
                    end.do_handshake()
                    done[end] = True
                except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                    pass
                except ssl.SSLError as exc:
                    return getattr(exc, "verify_message", None) or exc.reason or str(exc)
            data = out.read()
            if data:
                peer_in.write(data)
        if all(done.values()):
            return None
    return "the handshake did not complete"


def _no_password() -> bytes:
    return b""  # an encrypted key (which grpc cannot use either) fails to load instead of prompting on a terminal
