"""Renewed TLS files are taken while the services run (`specdec.rpc.tls_reload`): the files live behind a
`..data` symlink swapped in one rename, as the kubelet updates a mounted Secret (cert-manager's renewals). After
the swap, new connections to every service present the new certificate and require clients of the new CA; the
gateway's and the draft's own channels move to the new files, so a target restarted on the new files is reached
again; a swap to files that do not load is refused and the set before stays in use."""

from __future__ import annotations

import os
import shutil
import time

import grpc
import pytest
from reliability_support import SERVING, TARGET_DIR, creds, health, make_certs, start_draft, start_target

from specdec.serving.service_thread import ServiceThread
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

FILES = ("server.pem", "server.key", "client.pem", "client.key", "ca.pem")


def swap(live, to) -> None:
    """Point `live/..data` at the directory `to` in one rename (what the kubelet does for a Secret's update)."""
    tmp = live / "..data_tmp"
    os.symlink(to, tmp)
    os.replace(tmp, live / "..data")


def flags(live, prefix: str = "", identity: str = "server") -> list[str]:
    return [f"--{prefix}tls-cert", str(live / f"{identity}.pem"), f"--{prefix}tls-key", str(live / f"{identity}.key"),
            f"--{prefix}tls-ca", str(live / "ca.pem")]


def answers(port: int, channel_creds) -> bool:
    """Whether a new connection with `channel_creds` gets a health answer (its handshake passed)."""
    return health(f"localhost:{port}", "", channel_creds) == SERVING


def pairs_up(port: int, channel_creds) -> int:
    with grpc.secure_channel(f"localhost:{port}", channel_creds) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        return stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10).models[0].pairs_up


def generate(port: int, channel_creds) -> gateway_pb2.GatewayServiceGenerateResponse:
    request = gateway_pb2.GatewayServiceGenerateRequest(prompt="def fib(n):", sampling=common_pb2.SamplingParams(
        max_new_tokens=12))
    with grpc.secure_channel(f"localhost:{port}", channel_creds) as ch:
        return list(gateway_pb2_grpc.GatewayServiceStub(ch).Generate(request, timeout=30))


def wait_speculative(port: int, channel_creds, timeout_s: float, what: str) -> list:
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        try:
            msgs = generate(port, channel_creds)
            if msgs[-1].final.speculative:
                return msgs
            last = "served without its draft"
        except grpc.RpcError as exc:
            last = f"{exc.code().name}: {exc.details()}"
        assert time.monotonic() < deadline, f"{what}: {last}"
        time.sleep(0.25)


@pytest.fixture
def live_certs(tmp_path):
    sets = {name: make_certs(tmp_path / name) for name in ("a", "b")}
    # a set whose server key is not its certificate's (b's certificate, a's key): it must not be taken
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "b", broken)
    shutil.copy(tmp_path / "a" / "server.key", broken / "server.key")
    live = tmp_path / "live"
    live.mkdir()
    os.symlink(tmp_path / "a", live / "..data")
    for name in FILES:
        os.symlink(f"..data/{name}", live / name)
    return live, sets, broken


def test_reliability_renewed_tls_files_are_taken_by_every_service(live_certs):
    live, sets, broken = live_certs
    a, b = creds(sets["a"]), creds(sets["b"])
    target = start_target(*flags(live))
    draft = start_draft(f"localhost:{target.port}", *flags(live), *flags(live, "target-", "client"))
    from gateway.serve import serve

    gateway = ServiceThread(serve, ["serve-gateway", "--model", TARGET_DIR, "--port", "0", "--drain-seconds", "2",
                                    "--pair", f"localhost:{draft.port}=localhost:{target.port}", *flags(live)]).start()
    restarted = None
    try:
        before = wait_speculative(gateway.port, a, 30, "the stack never served over mutual TLS")

        swap(live, live.parent / "b")
        for port in (gateway.port, draft.port, target.port):  # new handshakes: the new certificate and CA
            assert answers(port, b), port
            assert not answers(port, a), port

        # the target restarts on the new files: only channels that moved to them reach it again
        time.sleep(3.0)  # one round of the gateway's health loop and of the draft's target watch (2 s each)
        target.stop()
        restarted = start_target(*flags(live), "--port", str(target.port))
        after = wait_speculative(gateway.port, b, 30, "the draft or the gateway kept the old certificates")
        assert [m.text for m in after] == [m.text for m in before]
        time.sleep(3.0)  # the gateway's health loop looks at the restarted target again: it stays up
        assert pairs_up(gateway.port, b) == 1

        swap(live, broken)  # refused: the servers keep presenting b
        assert answers(restarted.port, b) and answers(draft.port, b) and answers(gateway.port, b)
        assert wait_speculative(gateway.port, b, 10, "a refused set broke the stack")[-1].final.speculative
    finally:
        for service in (gateway, draft, restarted or target):
            service.stop()
