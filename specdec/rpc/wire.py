"""Replies that carry a feature tensor, encoded without protobuf's copies of the tensor's bytes.

Setting a large `bytes` field and serializing the message costs far more than copying the bytes (upb, 31 MB of
features: 19 ms to set the field, 22 ms to serialize, vs 1.7 ms for one memcpy; docs/benchmarks.md). The target's
Prefill and Verify replies are mostly such bytes, so they are encoded here instead: protobuf serializes the
message without its tensor, and the tensor's field is appended in protobuf's wire format around the raw bytes
(one copy, by `b"".join`). The result is the same message on the wire: any protobuf parser reads it, and a field
that appears once may come last.

    reply = encode_with_tensor(msg, "features", host_tensor)     # bytes, for a handler to return
    add_servicer(target_pb2.DESCRIPTOR.services_by_name["TargetService"], servicer, server)

`add_servicer` registers a servicer like the generated `add_*Servicer_to_server`, except that a handler may also
return already encoded `bytes`.
"""

from __future__ import annotations

import grpc
import torch
from google.protobuf import message_factory

from specdec.rpc.tensor_codec import tensor_dtype_name
from specdec.v1 import common_pb2

_LEN = 2  # wire type of length-delimited fields
_DATA = common_pb2.Tensor.DESCRIPTOR.fields_by_name["data"].number


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field_number: int) -> bytes:
    return _varint(field_number << 3 | _LEN)


def tensor_parts(t: torch.Tensor) -> list:
    """The wire encoding of `specdec.v1.Tensor` for host tensor `t`, as parts to join (the data part is a view
    of `t`'s memory, not a copy)."""
    name = tensor_dtype_name(t.dtype)
    t = t.detach().to("cpu").contiguous()  # no copy for a contiguous host tensor (see features_to_host)
    head = common_pb2.Tensor(dtype=name, shape=list(t.shape)).SerializeToString()
    if t.numel() == 0:
        return [head]
    raw = t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)
    data = memoryview(raw.numpy()).cast("B")
    return [head, _key(_DATA), _varint(data.nbytes), data]


def encode_with_tensor(msg, field: str, t: torch.Tensor | None) -> bytes:
    """`msg` (its `field` unset) serialized, with `t` as its Tensor-typed `field`; None: `msg` as it is."""
    body = msg.SerializeToString()
    if t is None:
        return body
    number = msg.DESCRIPTOR.fields_by_name[field].number
    parts = tensor_parts(t)
    size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    return b"".join([body, _key(number), _varint(size), *parts])


def _serializer(cls):
    serialize = cls.SerializeToString

    def serializer(reply) -> bytes:
        return reply if isinstance(reply, bytes) else serialize(reply)

    return serializer


def add_servicer(service, servicer, server) -> None:
    """Register `servicer`'s methods for `service` (a ServiceDescriptor); handlers may return encoded bytes."""
    handlers = {}
    for method in service.methods:
        request = message_factory.GetMessageClass(method.input_type)
        reply = message_factory.GetMessageClass(method.output_type)
        kind = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(getattr(servicer, method.name), request_deserializer=request.FromString,
                                     response_serializer=_serializer(reply))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
