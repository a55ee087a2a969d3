"""Features as 8-bit floats with a scale per row (`--feature-wire fp8`, Tensor dtype float8_e4m3fn_rowscaled):
packed on the target's device, the same bytes through the raw-bytes encoder as through protobuf, unpacked on the
draft's device within float8's rounding, malformed blobs refused."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.requests import RUNNING, STOP, VerifyOutput
from specdec.errors import InvalidInput
from specdec.rpc.target_codec import features_to_host, verify_outputs_from_proto, verify_reply_bytes
from specdec.rpc.tensor_codec import FP8_ROWS, pack_fp8_rows, tensor_from_proto, tensor_to_proto, unpack_fp8_rows
from specdec.rpc.wire import RawTensor, decode_with_tensor
from specdec.v1 import common_pb2, target_pb2


def test_rows_round_trip_within_float8_rounding_whatever_their_scale():
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(0))
    x = x * torch.tensor([1.0, 1e3, 1e-3, 60.0, 0.0, 1e-20])[:, None]  # a zero row, a tiny one
    packed = pack_fp8_rows(x)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 260)
    back = unpack_fp8_rows(packed)
    err = (back - x).abs() / x.abs().amax(dim=1, keepdim=True).clamp_min(1e-38)
    assert err.max().item() <= 2**-4  # e4m3: 3 mantissa bits, relative to the row's largest element
    assert torch.equal(back[4], torch.zeros(256))
    msg = tensor_to_proto(packed)
    assert msg.dtype == FP8_ROWS and list(msg.shape) == [6, 256] and len(msg.data) == 6 * 260
    assert torch.equal(tensor_from_proto(msg, expected_dim=256, expected_rows=6), back)


def test_a_verify_reply_in_fp8_parses_like_protobuf_and_unpacks_per_request():
    feats = torch.randn(7, 32).to(torch.bfloat16)
    outs = [VerifyOutput("a", [1, 2, 3], 2, feats[:3]), VerifyOutput("b", [4], 0, feats[3:4], STOP),
            VerifyOutput("c", [5, 6, 7], 2, feats[4:])]
    features_to_host(outs, packed={"a", "b", "c"})
    assert all(o.features.dtype == torch.uint8 for o in outs)
    data = verify_reply_bytes(outs)
    parsed = target_pb2.VerifyResponse.FromString(data)  # protobuf reads our encoding
    assert parsed.features.dtype == FP8_ROWS and list(parsed.features.shape) == [6, 32]
    msg, raw = decode_with_tensor(target_pb2.VerifyResponse, data, "features")
    assert isinstance(raw, RawTensor)
    back = verify_outputs_from_proto(msg, features=raw, expected_dim=32)
    assert back[1].features is None
    for got, want in ((back[0].features, feats[:3]), (back[2].features, feats[4:])):
        assert got.dtype == torch.float32 and got.shape == want.shape
        assert ((got - want.float()).abs().amax(dim=1) <= want.float().abs().amax(dim=1) * 2**-4).all()


def test_only_the_asked_for_requests_are_packed():
    outs = [VerifyOutput("a", [1], 0, torch.ones(1, 8)), VerifyOutput("b", [2], 0, torch.ones(1, 8), RUNNING)]
    features_to_host(outs, packed={"b"})
    assert outs[0].features.dtype == torch.float32 and outs[1].features.dtype == torch.uint8


@pytest.mark.parametrize("msg,match", [
    (common_pb2.Tensor(dtype=FP8_ROWS, shape=[2, 4], data=b"\0" * 15), "needs 16"),
    (common_pb2.Tensor(dtype=FP8_ROWS, shape=[8], data=b"\0" * 8), "expected \\[rows, cols\\]"),
    (common_pb2.Tensor(dtype=FP8_ROWS, shape=[2, -1], data=b""), "expected \\[rows, cols\\]"),
])
def test_malformed_fp8_blobs_raise_invalid_input(msg, match):
    with pytest.raises(InvalidInput, match=match):
        tensor_from_proto(msg)


def test_an_empty_fp8_blob():
    t = tensor_from_proto(common_pb2.Tensor(dtype=FP8_ROWS, shape=[0, 16], data=b""))
    assert t.shape == (0, 16)
