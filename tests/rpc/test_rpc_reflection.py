"""Server reflection under both names (v1alpha and v1), and the file of a method, a field or an enum value."""

from __future__ import annotations

import asyncio
import subprocess

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

from specdec.rpc.reflection import V1_SERVICE, V1ALPHA_SERVICE, v1_file

TARGET = "specdec.v1.TargetService"
NAMES = (V1ALPHA_SERVICE, V1_SERVICE)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


async def ask(channel, service: str, **request) -> reflection_pb2.ServerReflectionResponse:
    """One reflection request over `service`'s path (the messages of both are the same bytes)."""
    call = channel.stream_stream(f"/{service}/ServerReflectionInfo",
                                 request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                 response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
    stream = call()
    await stream.write(reflection_pb2.ServerReflectionRequest(**request))
    await stream.done_writing()
    (reply,) = [r async for r in stream]
    return reply


def files_of(reply) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    files = {}
    for data in reply.file_descriptor_response.file_descriptor_proto:
        proto = descriptor_pb2.FileDescriptorProto.FromString(data)
        files[proto.name] = proto
    return files


def answers(fake_server, *requests: dict) -> dict[str, list]:
    """Per reflection name, the replies to `requests`, asked of a running fake target."""
    async def body():
        async with fake_server() as (handle, _), grpc.aio.insecure_channel(f"127.0.0.1:{handle.bound_port}") as ch:
            return {name: [await ask(ch, name, **r) for r in requests] for name in NAMES}

    return run(body())


def test_both_reflection_names_list_the_same_services(fake_server):
    got = answers(fake_server, {"list_services": ""})
    listed = {name: {s.name for s in replies[0].list_services_response.service} for name, replies in got.items()}
    assert listed[V1_SERVICE] == listed[V1ALPHA_SERVICE] == {TARGET, "grpc.health.v1.Health", *NAMES}


@pytest.mark.parametrize(("symbol", "file"), [
    (TARGET, "specdec/v1/target.proto"),
    (f"{TARGET}.Verify", "specdec/v1/target.proto"),  # a method: `Symbol not found` before
    ("specdec.v1.TreeProposal.parents", "specdec/v1/target.proto"),  # a field
    ("specdec.v1.FinishReason.FINISH_REASON_STOP", "specdec/v1/common.proto"),  # an enum's value
    (V1_SERVICE, "grpc/reflection/v1/reflection.proto"),
    (f"{V1_SERVICE}.ServerReflectionInfo", "grpc/reflection/v1/reflection.proto"),
])
def test_a_symbol_is_found_in_its_file_under_both_names(fake_server, symbol, file):
    for name, (reply,) in answers(fake_server, {"file_containing_symbol": symbol}).items():
        files = files_of(reply)
        assert file in files, (name, symbol, sorted(files))


@pytest.mark.parametrize("symbol", [f"{TARGET}.NoSuchMethod", "specdec.v1.TreeProposal.nope", "specdec.v1.Nope",
                                    "specdec.v1"])
def test_an_unknown_symbol_is_not_found(fake_server, symbol):
    for reply in (replies[0] for replies in answers(fake_server, {"file_containing_symbol": symbol}).values()):
        assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_the_v1_file_is_v1alpha_under_the_v1_package():
    alpha = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(alpha)
    v1 = v1_file()
    assert v1.package == "grpc.reflection.v1" and not v1.dependency
    fields = lambda f: {(m.name, x.name, x.number, x.type, x.type_name.rsplit(".", 1)[-1])  # noqa: E731
                        for m in f.message_type for x in m.field}
    assert fields(v1) == fields(alpha)  # the same messages: the same bytes on the wire
    assert all(x.type_name.startswith(".grpc.reflection.v1.") for m in v1.message_type for x in m.field
               if x.type_name)
    (method,) = v1.service[0].method
    assert (method.input_type, method.output_type) == (".grpc.reflection.v1.ServerReflectionRequest",
                                                       ".grpc.reflection.v1.ServerReflectionResponse")


def test_grpcurl_describes_a_method(fake_server, grpcurl):
    """grpcurl asks v1 first: the method's own line, as with a Go server."""
    async def body():
        async with fake_server() as (handle, _):
            addr = f"127.0.0.1:{handle.bound_port}"
            out = await asyncio.to_thread(subprocess.run, [grpcurl, "-plaintext", addr, "describe", f"{TARGET}.Verify"],
                                          capture_output=True, text=True, timeout=15)
            return out

    out = run(body())
    assert out.returncode == 0, out.stderr
    assert "specdec.v1.TargetService.Verify is a method" in out.stdout
    assert "rpc Verify ( .specdec.v1.VerifyRequest )" in out.stdout
