"""tensor_codec: exact round trips for every wire dtype, and clear InvalidInput for malformed blobs."""

from __future__ import annotations

import pytest
import torch

from specdec.errors import InvalidInput
from specdec.rpc.tensor_codec import tensor_from_proto, tensor_to_proto
from specdec.v1 import common_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype):
    t = torch.randn(5, 12).to(dtype)  # [rows, dim]
    t[0, 0] = float("nan")  # raw bits survive, no float conversion in between
    msg = tensor_to_proto(t)
    assert msg.dtype == str(dtype).removeprefix("torch.")
    assert list(msg.shape) == [5, 12]
    assert len(msg.data) == t.numel() * t.element_size()
    back = tensor_from_proto(msg, expected_dim=12, expected_rows=5)
    assert back.dtype == dtype and back.shape == t.shape
    bits = torch.int16 if t.element_size() == 2 else torch.int32
    assert torch.equal(back.view(bits), t.view(bits))


def test_non_contiguous_and_bytes_layout():
    t = torch.arange(12, dtype=torch.float32).view(3, 4).t()  # non-contiguous [4, 3]
    msg = tensor_to_proto(t)
    assert msg.data == t.contiguous().numpy().tobytes()  # row-major little-endian
    assert torch.equal(tensor_from_proto(msg), t)


def test_bfloat16_bytes_are_the_raw_bit_pattern():
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert tensor_to_proto(t).data == bytes([0x80, 0x3F, 0x00, 0xC0])


@pytest.mark.parametrize("shape", [[0, 8], [0], [3, 0, 2]])
def test_empty(shape):
    msg = tensor_to_proto(torch.empty(shape, dtype=torch.bfloat16))
    assert msg.data == b""
    back = tensor_from_proto(msg)
    assert list(back.shape) == shape and back.dtype == torch.bfloat16


def test_scalar():
    back = tensor_from_proto(tensor_to_proto(torch.tensor(3.5)))
    assert back.shape == () and back.item() == 3.5


def test_device_argument_copies():
    msg = tensor_to_proto(torch.ones(2, 2))
    back = tensor_from_proto(msg, device="cpu")
    assert back.device.type == "cpu" and torch.equal(back, torch.ones(2, 2))


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        (common_pb2.Tensor(dtype="int64", shape=[1], data=b"\0" * 8), "dtype 'int64'"),
        (common_pb2.Tensor(dtype="", shape=[1], data=b"\0" * 4), "dtype ''"),
        (common_pb2.Tensor(dtype="float32", shape=[2, 3], data=b"\0" * 20), "20 bytes .* needs 24"),
        (common_pb2.Tensor(dtype="bfloat16", shape=[4], data=b"\0" * 9), "9 bytes"),
        (common_pb2.Tensor(dtype="float16", shape=[-1, 2], data=b""), "negative"),
        (common_pb2.Tensor(dtype="float32", shape=[-2, -3], data=b"\0" * 24), "negative"),
    ],
)
def test_malformed_tensors_raise_invalid_input(msg, match):
    with pytest.raises(InvalidInput, match=match):
        tensor_from_proto(msg)


def test_expected_shape_checks():
    msg = tensor_to_proto(torch.zeros(3, 4))
    with pytest.raises(InvalidInput, match="expected last dimension 8"):
        tensor_from_proto(msg, expected_dim=8)
    with pytest.raises(InvalidInput, match="expected 2 rows"):
        tensor_from_proto(msg, expected_rows=2)


def test_unsupported_dtype_is_refused_when_packing():
    with pytest.raises(InvalidInput, match="int64"):
        tensor_to_proto(torch.zeros(2, dtype=torch.int64))
