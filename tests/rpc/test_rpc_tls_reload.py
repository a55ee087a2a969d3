"""TLS files read again while a server runs (`specdec.rpc.tls_reload`): the next handshake after a change presents
the new certificate and trusts the new CA; files that do not load are refused once, in words, and the set before
stays in use; the same bytes written again are no change; a bad set is refused at start-up with the files named."""

from __future__ import annotations

import asyncio
import logging
import shutil

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
            assert len(refused) == 1 and "the private key is not the certificate's" in refused[0].getMessage()
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
    shutil.copy(sets["b"] / "client.key", live / "client.key")
    material = watch.changed()
    assert material is not None and material.cert == (sets["b"] / "client.pem").read_bytes()
    assert watch.taken == material and watch.changed() is None


@pytest.mark.parametrize("bad,why", [
    ("key", "the private key is not the certificate's"),
    ("pem", "must each be PEM"),
    ("ca", "the CA bundle holds no PEM certificate"),
])
def test_files_that_do_not_load_are_refused_at_start_naming_them(sets, bad, why):
    live = sets["live"]
    if bad == "key":
        shutil.copy(sets["b"] / "server.key", live / "server.key")
    elif bad == "pem":
        (live / "server.pem").write_bytes(b"not a certificate")
    else:
        (live / "ca.pem").write_text("")
    with pytest.raises(ConfigError, match=why) as err:
        tls_of(live).server_credentials()
    assert str(live / "server.pem") in str(err.value)
