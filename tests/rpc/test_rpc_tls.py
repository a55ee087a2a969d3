"""TLS and mutual TLS with certificates made in the test, and the --tls-* flags."""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc
import grpc.aio
import pytest

from gateway.commands import rpc_error_text
from specdec.errors import ConfigError
from specdec.rpc.channel import make_channel
from specdec.rpc.server import TlsConfig, add_tls_args
from specdec.v1 import target_pb2, target_pb2_grpc


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


async def model_info(addr: str, tls: TlsConfig | None) -> str:
    async with make_channel(addr, tls) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        reply = await stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(), timeout=5)
        return reply.model


async def refused(addr: str, tls: TlsConfig | None) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await model_info(addr, tls)
    return err.value.code()


def test_tls(fake_server, certs):
    server_tls = TlsConfig(cert=f"{certs['server']}.pem", key=f"{certs['server']}.key")

    async def body():
        async with fake_server(tls=server_tls) as (handle, _):
            assert (
                await model_info(f"localhost:{handle.bound_port}", TlsConfig(ca=f"{certs['ca']}.pem"))
                == "fake"
            )
            assert await refused(f"localhost:{handle.bound_port}", None) == grpc.StatusCode.UNAVAILABLE

    run(body())


def test_optional_client_certificates_without_a_ca_are_said_to_do_nothing(caplog):
    """`--tls-client-certs optional` with no `--tls-ca` asks for nothing either way: the gateway says so in its log
    instead of taking the flag silently (QA)."""
    from gateway.serve import server_tls
    from specdec.cli import build_parser

    with caplog.at_level(logging.WARNING, logger="gateway.serve"):
        args = build_parser().parse_args(["serve-gateway", "--model", "m", "--pair", "a:1=b:2"])
        assert server_tls(args) is None and not caplog.records
        args = build_parser().parse_args(["serve-gateway", "--model", "m", "--pair", "a:1=b:2",
                                          "--tls-client-certs", "optional"])
        assert server_tls(args) is None
    assert any("does nothing without --tls-ca" in r.getMessage() for r in caplog.records)


def test_mutual_tls_requires_a_client_certificate(fake_server, certs):
    server_tls = TlsConfig(
        cert=f"{certs['server']}.pem",
        key=f"{certs['server']}.key",
        ca=f"{certs['ca']}.pem",
        require_client_cert=True,
    )
    with_client_cert = TlsConfig(
        cert=f"{certs['client']}.pem", key=f"{certs['client']}.key", ca=f"{certs['ca']}.pem"
    )
    without = TlsConfig(ca=f"{certs['ca']}.pem")

    async def body():
        async with fake_server(tls=server_tls) as (handle, _):
            addr = f"localhost:{handle.bound_port}"
            assert await model_info(addr, with_client_cert) == "fake"
            assert await refused(addr, without) == grpc.StatusCode.UNAVAILABLE
            texts = []
            for client in (without, None):  # no client certificate; plaintext
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await model_info(addr, client)
                texts.append(rpc_error_text(err.value, None))
            return texts

    # what `specdec generate` prints: only the server's log said it was TLS (QA)
    for text in run(body()):
        assert text.startswith("UNAVAILABLE: ") and "if it serves TLS, pass --tls-ca" in text, text


def test_a_plaintext_draft_is_told_its_target_may_serve_tls(fake_server, certs):
    """A draft started without --target-tls-* against a TLS target: its start-up error said `Connection refused` or
    `Socket closed` and nothing of TLS (QA)."""
    from draft_service.target_client import TargetClient
    from specdec.errors import SpecdecError

    server_tls = TlsConfig(cert=f"{certs['server']}.pem", key=f"{certs['server']}.key", ca=f"{certs['ca']}.pem",
                           require_client_cert=True)

    async def body():
        async with fake_server(tls=server_tls) as (handle, _):
            client = TargetClient(f"localhost:{handle.bound_port}")
            try:
                with pytest.raises(SpecdecError) as err:
                    await asyncio.to_thread(client.model_info, 3.0)
            finally:
                client.close()
            return str(err.value)

    text = run(body())
    assert "if it serves TLS, pass --target-tls-ca" in text, text


def test_a_target_that_answered_and_then_went_away_gets_no_tls_hint(fake_server):
    """A plaintext target killed mid-Prefill ends the call `UNAVAILABLE ... Socket closed`, as a TLS refusal does;
    once the target has answered over the same credentials it is not a handshake, so no TLS hint (QA: the gateway
    logged one for every killed plaintext target). Once the draft's target watch has found it away, the hint comes
    back: the target may have restarted with TLS (QA: a plaintext draft then only ever said `Socket closed`)."""
    from draft_service.target_client import TargetClient

    class Closed(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "Stream removed (Socket closed)"

    async def body():
        async with fake_server() as (handle, _):
            addr = f"localhost:{handle.bound_port}"
            fresh, answered = TargetClient(addr), TargetClient(addr)
            try:
                await asyncio.to_thread(answered.model_info, 3.0)
                before = str(answered._failed(Closed(), answered._link, watched=False))
                # the target watch found it away (its calls abandoned): what answers next may serve TLS
                answered.abandon_calls("the target does not answer")
                return (str(fresh._failed(Closed(), fresh._link, watched=False)), before,
                        str(answered._failed(Closed(), answered._link, watched=False)))
            finally:
                fresh.close()
                answered.close()

    never, after, away = run(body())
    assert "if it serves TLS" in never and "Socket closed" in after and "TLS" not in after
    assert "if it serves TLS, pass --target-tls-ca" in away


def test_flags():
    parser = argparse.ArgumentParser()
    add_tls_args(parser)
    add_tls_args(parser, prefix="target-", who="calls to the target")
    assert TlsConfig.from_args(parser.parse_args([])) is None
    args = parser.parse_args(["--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem"])
    assert TlsConfig.from_args(args) == TlsConfig("c.pem", "k.pem", "ca.pem", require_client_cert=True)
    assert TlsConfig.from_args(args, prefix="target-") is None
    client = TlsConfig.from_args(parser.parse_args(["--target-tls-ca", "ca.pem"]), prefix="target-")
    assert client == TlsConfig(ca="ca.pem")
    with pytest.raises(ConfigError, match="--tls-key"):
        TlsConfig.from_args(parser.parse_args(["--tls-cert", "c.pem"]))


def test_missing_files_are_config_errors(tmp_path):
    tls = TlsConfig(cert=str(tmp_path / "nope.pem"), key=str(tmp_path / "nope.key"))
    with pytest.raises(ConfigError, match="nope"):
        tls.server_credentials()


def test_gateway_client_certificates_can_be_optional(fake_server, certs):
    """`serve-gateway --tls-client-certs optional` (an Ingress in front, which has no client certificate): clients
    with and without one are served; the pairs are still reached with the gateway's certificate."""
    from gateway.serve import pair_tls, server_tls
    from specdec.cli import build_parser

    files = [f"--tls-cert={certs['server']}.pem", f"--tls-key={certs['server']}.key", f"--tls-ca={certs['ca']}.pem"]
    args = build_parser().parse_args(["serve-gateway", "--model", "m", "--pair", "a:1=b:2", *files])
    assert server_tls(args).require_client_cert
    args = build_parser().parse_args(["serve-gateway", "--model", "m", "--pair", "a:1=b:2", *files,
                                      "--tls-client-certs", "optional"])
    tls = server_tls(args)
    assert not tls.require_client_cert and pair_tls(tls).cert == tls.cert and pair_tls(tls).ca == tls.ca
    with_client_cert = TlsConfig(cert=f"{certs['client']}.pem", key=f"{certs['client']}.key", ca=f"{certs['ca']}.pem")

    async def body():
        async with fake_server(tls=tls) as (handle, _):
            addr = f"localhost:{handle.bound_port}"
            assert await model_info(addr, with_client_cert) == "fake"
            assert await model_info(addr, TlsConfig(ca=f"{certs['ca']}.pem")) == "fake"

    run(body())
