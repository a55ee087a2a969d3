"""gRPC server reflection under both of its names: `grpc.reflection.v1alpha.ServerReflection`, the one
grpcio-reflection serves, and `grpc.reflection.v1.ServerReflection`, which newer clients ask first (grpcurl, buf curl)
and some ask only.

The two protocols are one: v1 is v1alpha promoted under a new package, the same messages with the same field
numbers. So the v1 name is served by the same servicer, its messages read and written with v1alpha's classes (the
bytes are the same), and the v1 file's descriptor, made from v1alpha's by renaming its package, is added to the
pool so that a client may `describe` the v1 service like any other. Both also find the file of a method, a field or
an enum value (`grpcurl describe specdec.v1.GatewayService.Generate`), which the pool alone does not (`Symbols`).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_SERVICE = reflection.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"
METHOD = "ServerReflectionInfo"


def enable_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Reflection on `server` under both names, listing `service_names` and the two reflection services."""
    _add_v1_file(descriptor_pool.Default())
    names = (*service_names, V1_SERVICE, V1ALPHA_SERVICE)
    servicer = reflection.aio.ReflectionServicer(names, pool=Symbols(descriptor_pool.Default()))
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE, {METHOD: v1}),))


def v1_file() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's reflection.proto under the v1 package and file name."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")  # (language options naming v1alpha's packages)
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = f".{V1_PACKAGE}.{field.type_name.removeprefix(old)}"
    for service in proto.service:
        for method in service.method:
            method.input_type = f".{V1_PACKAGE}.{method.input_type.removeprefix(old)}"
            method.output_type = f".{V1_PACKAGE}.{method.output_type.removeprefix(old)}"
    return proto


class Symbols:
    """A descriptor pool for reflection that also finds the file of a service's method, a message's field or an enum's
    value, as other languages' reflection servers do: protobuf's own pool finds only what a file declares at its
    top level or nests (`describe specdec.v1.GatewayService.Generate` answered `Symbol not found`)."""

    _MEMBERS = (("FindServiceByName", "methods_by_name"), ("FindMessageTypeByName", "fields_by_name"),
                ("FindEnumTypeByName", "values_by_name"))

    def __init__(self, pool: descriptor_pool.DescriptorPool) -> None:
        self._pool = pool

    def __getattr__(self, name: str):
        return getattr(self._pool, name)

    def FindFileContainingSymbol(self, symbol: str):  # noqa: N802 (the pool's own name)
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            parent, _, member = symbol.rpartition(".")
            for find, members in self._MEMBERS:
                try:
                    owner = getattr(self._pool, find)(parent)
                except KeyError:
                    continue
                if member in getattr(owner, members):
                    return owner.file
            raise


def _add_v1_file(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindFileByName(V1_FILE)
    except KeyError:
        pool.AddSerializedFile(v1_file().SerializeToString())
