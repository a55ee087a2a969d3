"""Replies that carry a feature tensor, encoded without protobuf's copies of the tensor's bytes.

Setting a large `bytes` field and serializing the message costs far more than copying the bytes (upb, 31 MB of
features: 19 ms to set the field, 22 ms to serialize, vs 1.7 ms for one memcpy; docs/benchmarks.md). The target's
Prefill and Verify replies are mostly such bytes, so they are encoded here instead: protobuf serializes the
message without its tensor, and the tensor's field is appended in protobuf's wire format around the raw bytes
(one copy, by `b"".join`). The result is the same message on the wire: any protobuf parser reads it (fields
may come in any order; the tensor comes first, so the receiver finds it without walking the rest).

    reply = encode_with_tensor(msg, "features", host_tensor)     # bytes, for a handler to return
    add_servicer(target_pb2.DESCRIPTOR.services_by_name["TargetService"], servicer, server)

`add_servicer` registers a servicer like the generated `add_*Servicer_to_server`, except that a handler may also
return already encoded `bytes`. On the receiving end `decode_with_tensor` reads the tensor's bytes where they lie
in the received reply (no copy) and lets protobuf parse the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch
from google.protobuf import message_factory

from specdec.rpc.tensor_codec import host_raw
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
    name, shape, raw = host_raw(t)  # no copy for a contiguous host tensor (see features_to_host)
    head = common_pb2.Tensor(dtype=name, shape=shape).SerializeToString()
    if raw.nbytes == 0:
        return [head]
    data = memoryview(raw)
    return [head, _key(_DATA), _varint(data.nbytes), data]


def encode_with_tensor(msg, field: str, t: torch.Tensor | None) -> bytes:
    """`msg` (its `field` unset) serialized, with `t` as its Tensor-typed `field`; None: `msg` as it is."""
    body = msg.SerializeToString()
    if t is None:
        return body
    number = msg.DESCRIPTOR.fields_by_name[field].number
    parts = tensor_parts(t)
    size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    return b"".join([_key(number), _varint(size), *parts, body])  # the tensor first: the receiver finds it at once


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


# ---- the other way: a reply's tensor read straight out of the received bytes ------------------------------------
@dataclass
class RawTensor:
    """A `specdec.v1.Tensor` whose `data` is a view of the received reply (reads like the message for
    `tensor_from_proto`)."""

    dtype: str
    shape: list[int]
    data: memoryview


class _Layout(Exception):
    """The bytes are not laid out as `encode_with_tensor` makes them (protobuf's parse takes over)."""


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _Layout("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview):
    """(field number, wire type, start of the key, start of the value, end of the field) of each field."""
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos)
        number, kind = key >> 3, key & 7
        value = pos
        if kind == 0:
            _, pos = _read_varint(buf, pos)
        elif kind == 1:
            pos += 8
        elif kind == 5:
            pos += 4
        elif kind == _LEN:
            size, value = _read_varint(buf, pos)
            pos = value + size
        else:
            raise _Layout(f"wire type {kind}")
        if pos > len(buf):
            raise _Layout("truncated field")
        yield number, kind, start, value, pos


def _raw_tensor(buf: memoryview) -> RawTensor:
    fields = common_pb2.Tensor.DESCRIPTOR.fields_by_name
    dtype_no, shape_no = fields["dtype"].number, fields["shape"].number
    dtype, shape, data = "", [], memoryview(b"")
    for number, kind, _, value, end in _fields(buf):
        if number == dtype_no and kind == _LEN:
            try:
                dtype = bytes(buf[value:end]).decode()
            except UnicodeDecodeError:
                raise _Layout("dtype is not UTF-8") from None
        elif number == shape_no and kind in (_LEN, 0):  # packed, or one element
            pos = value
            while pos < end:
                dim, pos = _read_varint(buf, pos)
                shape.append(dim - (1 << 64) if dim >= 1 << 63 else dim)  # int64: two's complement
        elif number == _DATA and kind == _LEN:
            data = buf[value:end]
        else:
            raise _Layout(f"tensor field {number}")
    return RawTensor(dtype, shape, data)


def decode_with_tensor(cls, data: bytes, field: str):
    """The inverse of `encode_with_tensor`: (the message without `field`, parsed by protobuf; `field`'s tensor as
    a RawTensor over `data`, or None when absent). Bytes laid out otherwise (valid protobuf all the same) are
    parsed by protobuf whole: (message, None) with `field` set in the message."""
    number = cls.DESCRIPTOR.fields_by_name[field].number
    buf = memoryview(data)
    try:
        first = next(_fields(buf), None)
        if first is not None and first[:2] == (number, _LEN):  # as encode_with_tensor lays it out
            _, _, _, value, end = first
            return cls.FromString(bytes(buf[end:])), _raw_tensor(buf[value:end])
        found = [(start, value, end) for n, kind, start, value, end in _fields(buf) if n == number]
        if not found:
            return cls.FromString(data), None
        if len(found) > 1:
            raise _Layout("the tensor field appears twice")
        start, value, end = found[0]
        tensor = _raw_tensor(buf[value:end])
        return cls.FromString(bytes(buf[:start]) + bytes(buf[end:])), tensor
    except _Layout:
        return cls.FromString(data), None
