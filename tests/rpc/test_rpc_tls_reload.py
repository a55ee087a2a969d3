"""TLS files read again while a server runs (`specdec.rpc.tls_reload`): the next handshake after a change presents
the new certificate and trusts the new CA; files that do not load are refused once, in words, and the set before
stays in use; the same bytes written again are no change; a bad set is refused at start-up with the files named."""

from __future__ import annotations

import asyncio
import logging
import shutil
import ssl

import pytest
from cert_factory import make_certs

from specdec.errors import ConfigError
from specdec.rpc.channel import make_channel
from specdec.rpc.server import TlsConfig
from specdec.rpc.tls_reload import tls_watch
from specdec.v1 import target_pb2, target_pb2_grpc


def tls_of(live, identity: str = "server") -> TlsConfig:
    return TlsConfig(cert=str(live / f"{identity}.pem"), key=str(live / f"{identity}.key"), ca=str(live / "ca.pem"),
                     require_client_cert=identity == "server")


def put(src, live) -> None:
    """Copy a set's files over the live ones (each file rewritten in place)."""
    for name in ("server.pem", "server.key", "client.pem", "client.key", "ca.pem"):
        shutil.copy(src / name, live / name)


async def answers(port: int, client: TlsConfig) -> bool:
    async with make_channel(f"localhost:{port}", client) as channel:
        try:
            await target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(
                target_pb2.TargetServiceGetModelInfoRequest(), timeout=5)
            return True
        except Exception:  # noqa: BLE001 - any failure to get through is a refusal here
            return False


@pytest.fixture
def sets(tmp_path):
    out = {name: tmp_path / name for name in ("a", "b")}
    for path in out.values():
        make_certs(path)
    out["live"] = tmp_path / "live"
    out["live"].mkdir()
    put(out["a"], out["live"])
    return out


def test_a_running_server_takes_renewed_files_at_its_next_handshake(fake_server, sets, caplog):
    live = sets["live"]

    async def body():
        async with fake_server(tls=tls_of(live)) as (handle, _):
            port = handle.bound_port
            assert await answers(port, tls_of(sets["a"], "client"))
            put(sets["b"], live)
            assert await answers(port, tls_of(sets["b"], "client"))  # b's certificate, b's clients
            assert not await answers(port, tls_of(sets["a"], "client"))
            shutil.copy(sets["a"] / "server.key", live / "server.key")  # a key that is not the certificate's
            with caplog.at_level(logging.WARNING, logger="specdec.rpc.file_watch"):
                for _ in range(3):
                    assert await answers(port, tls_of(sets["b"], "client"))  # b is still in use
            refused = [r for r in caplog.records if "cannot be used" in r.getMessage()]
            assert len(refused) == 1 and "is not the certificate's private key" in refused[0].getMessage()
            shutil.copy(sets["b"] / "server.key", live / "server.key")  # mended
            assert await answers(port, tls_of(sets["b"], "client"))

    asyncio.run(asyncio.wait_for(body(), timeout=30))


def test_a_client_watch_reports_only_a_new_set_that_loads(sets):
    live = sets["live"]
    watch = tls_watch(tls_of(live, "client"), "channel to x")
    assert watch.changed() is None
    put(sets["a"], live)  # the same bytes written again
    assert watch.changed() is None
    shutil.copy(sets["b"] / "client.pem", live / "client.pem")  # half a renewal: a's key, b's certificate
    assert watch.changed() is None
    shutil.copy(sets["b"] / "client.key", live / "client.key")  # b's pair, but a's CA: it no longer chains
    assert watch.changed() is None
    shutil.copy(sets["b"] / "ca.pem", live / "ca.pem")
    material = watch.changed()
    assert material is not None and material.cert == (sets["b"] / "client.pem").read_bytes()
    assert watch.taken == material and watch.changed() is None


@pytest.mark.parametrize("bad,file,why", [
    ("key", "server.key", "is not the certificate's private key"),
    ("pem", "server.pem", "does not load as PEM certificates"),
    ("ca", "ca.pem", "does not load as PEM certificates"),
    ("der", "server.pem", "does not load as PEM certificates"),
    ("der-ca", "ca.pem", "does not load as PEM certificates"),
    ("expired", "server.pem", "cannot be used as a server's: certificate has expired"),
])
def test_files_that_do_not_load_are_refused_at_start_naming_the_file(sets, tmp_path, bad, file, why):
    live = sets["live"]
    if bad == "key":
        shutil.copy(sets["b"] / "server.key", live / "server.key")
    elif bad == "pem":
        (live / "server.pem").write_bytes(b"not a certificate")
    elif bad == "ca":
        (live / "ca.pem").write_text("")
    elif bad.startswith("der"):  # binary, not ASCII (QA: a TypeError traceback from ssl's cadata)
        name = "ca.pem" if bad == "der-ca" else "server.pem"
        (live / name).write_bytes(ssl.PEM_cert_to_DER_cert((live / name).read_text()))
    else:
        put(make_certs(tmp_path / "old", expired=True)["ca"].parent, live)
    with pytest.raises(ConfigError, match=why) as err:
        tls_of(live).server_credentials()
    assert str(err.value).startswith(f"the {'key file' if bad == 'key' else 'certificate'}") or bad.endswith("ca")
    assert str(live / file) in str(err.value)


def test_text_around_the_pem_blocks_may_be_in_any_encoding(sets):
    """OpenSSL and grpc skip what lies outside the PEM blocks: a UTF-8 comment before each file's block loads (QA:
    a TypeError traceback, `cadata should be an ASCII string`)."""
    live = sets["live"]
    for name in ("server.pem", "ca.pem"):
        (live / name).write_bytes("# certificat émis par l'équipe — ü\n".encode() + (live / name).read_bytes())
    assert tls_of(live).server_credentials() is not None


def test_an_expired_renewal_or_a_ca_without_its_certificates_is_not_taken(sets, tmp_path):
    """Both cut every new connection once taken (QA): the set in use stays until a whole one arrives."""
    live = sets["live"]
    watch = tls_watch(tls_of(live, "client"), "channel to x")
    put(make_certs(tmp_path / "expired", expired=True)["ca"].parent, live)
    assert watch.changed() is None
    put(sets["a"], live)
    shutil.copy(sets["b"] / "ca.pem", live / "ca.pem")  # the new CA first, the certificates later
    assert watch.changed() is None
    assert watch.taken.cert == (sets["a"] / "client.pem").read_bytes() and watch.taken.chains_to_ca
    put(sets["b"], live)
    assert watch.changed() is not None and watch.taken.ca == (sets["b"] / "ca.pem").read_bytes()


def test_a_server_renewal_that_drops_a_name_is_not_taken(fake_server, sets, tmp_path, caplog):
    """A valid certificate of the same CA that no longer names `localhost` was taken, and every client's handshake
    failed its hostname check from then on (QA: a gateway's pairs all down within 0.1 s). It is refused with one
    WARNING; a renewal that keeps the names (and adds one) is taken."""
    live = sets["live"]
    other = make_certs(tmp_path / "other", hosts=("example.com",), ca=sets["a"] / "ca")
    more = make_certs(tmp_path / "more", hosts=("localhost", "127.0.0.1", "specdec.example"), ca=sets["a"] / "ca")

    async def body():
        async with fake_server(tls=tls_of(live)) as (handle, _):
            port = handle.bound_port
            assert await answers(port, tls_of(sets["a"], "client"))
            before = (live / "server.pem").read_bytes()
            put(other["ca"].parent, live)
            with caplog.at_level(logging.WARNING, logger="specdec.rpc.file_watch"):
                for _ in range(3):
                    assert await answers(port, tls_of(sets["a"], "client"))  # still a's certificate
            refused = [r.getMessage() for r in caplog.records if "no longer names" in r.getMessage()]
            assert len(refused) == 1, refused
            assert "no longer names 127.0.0.1, localhost (it names example.com)" in refused[0]
            assert (live / "server.pem").read_bytes() != before
            put(more["ca"].parent, live)
            assert await answers(port, tls_of(sets["a"], "client"))  # same CA: a's clients trust it
            assert await answers(port, tls_of(more["ca"].parent, "client"))

    asyncio.run(asyncio.wait_for(body(), timeout=30))


def test_certificate_names_and_wildcards():
    from specdec.rpc.tls_check import covers

    names = frozenset({"*.pair.ns.svc", "localhost"})
    assert covers(names, "localhost") and covers(names, "p-0.pair.ns.svc")
    assert not covers(names, "pair.ns.svc") and not covers(names, "a.b.pair.ns.svc")
    assert not covers(frozenset({"p-0.pair.ns.svc"}), "*.pair.ns.svc")


def test_a_certificate_from_another_ca_than_the_bundle_still_serves(sets):
    """A server certificate from a public CA with a private CA bundle for client certificates: its chain is not
    the bundle's, and it is used (only its dates and purpose are checked)."""
    live = sets["live"]
    shutil.copy(sets["b"] / "server.pem", live / "server.pem")
    shutil.copy(sets["b"] / "server.key", live / "server.key")
    material = tls_of(live).load()
    assert not material.chains_to_ca and material.cert == (sets["b"] / "server.pem").read_bytes()
