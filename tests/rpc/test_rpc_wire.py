"""specdec.rpc.wire: replies encoded around the features' raw bytes are the same protobuf messages as protobuf's
own encoding, for every dtype, shape and reply the target sends."""

from __future__ import annotations

import random

import pytest
import torch
from google.protobuf.message import DecodeError

from specdec.engine.requests import RUNNING, STOP, PrefillOutput, VerifyOutput
from specdec.rpc.target_codec import (
    prefill_output_to_proto,
    prefill_reply_bytes,
    verify_outputs_from_proto,
    verify_outputs_to_proto,
    verify_reply_bytes,
)
from specdec.rpc.tensor_codec import tensor_from_proto
from specdec.rpc.wire import RawTensor, decode_with_tensor, encode_with_tensor
from specdec.v1 import common_pb2, target_pb2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(0, 8), (1, 1), (3, 5), (200, 4096)])
def test_tensor_field_encodes_like_protobuf(dtype, shape):
    t = torch.randn(shape).to(dtype)
    msg = target_pb2.PrefillResponse(request_id="r", first_token=7)
    ours = encode_with_tensor(msg, "features", t)
    reference = prefill_output_to_proto(PrefillOutput("r", 7, t, RUNNING))
    assert target_pb2.PrefillResponse.FromString(ours) == reference
    assert len(ours) == len(reference.SerializeToString())  # the same fields, the tensor moved to the front


def test_verify_reply_bytes_parse_to_the_same_reply():
    batch = torch.randn(9, 16).to(torch.bfloat16)
    rows = batch.split([4, 2, 3])
    outs = [VerifyOutput("a", [1, 2, 3, 4], 3, rows[0]), VerifyOutput("b", [5], 0, rows[1][:1], STOP),
            VerifyOutput("c", [6, 7, 8], 2, rows[2])]
    parsed = target_pb2.VerifyResponse.FromString(verify_reply_bytes(outs))
    assert parsed == verify_outputs_to_proto(outs)
    back = verify_outputs_from_proto(parsed)
    assert torch.equal(back[0].features, rows[0]) and back[1].features is None and torch.equal(back[2].features,
                                                                                               rows[2])
    none = [VerifyOutput("d", [9], 0, None, STOP)]
    assert target_pb2.VerifyResponse.FromString(verify_reply_bytes(none)) == verify_outputs_to_proto(none)


def test_prefill_reply_without_features():
    out = PrefillOutput("r", 3, None, STOP)
    assert target_pb2.PrefillResponse.FromString(prefill_reply_bytes(out)) == prefill_output_to_proto(out)


def test_large_field_lengths_use_multi_byte_varints():
    t = torch.zeros(3000, 100, dtype=torch.float32)  # 1.2 MB: a 3-byte length
    msg = common_pb2.Tensor()
    parsed = target_pb2.VerifyResponse.FromString(encode_with_tensor(target_pb2.VerifyResponse(), "features", t))
    msg.CopyFrom(parsed.features)
    assert list(msg.shape) == [3000, 100] and len(msg.data) == 1_200_000


def _raw_equals(raw, t: torch.Tensor) -> bool:
    got = tensor_from_proto(raw)
    return got.dtype == t.dtype and torch.equal(got, t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_the_tensor_in_place_and_the_rest_like_protobuf(dtype):
    batch = torch.randn(7, 12).to(dtype)
    outs = [VerifyOutput("a", [1, 2, 3], 2, batch[:3]), VerifyOutput("b", [4, 5, 6, 7], 3, batch[3:])]
    data = verify_reply_bytes(outs)
    msg, raw = decode_with_tensor(target_pb2.VerifyResponse, data, "features")
    assert isinstance(raw, RawTensor) and _raw_equals(raw, batch)
    assert not msg.HasField("features") and msg.results == verify_outputs_to_proto(outs).results
    back = verify_outputs_from_proto(msg, features=raw)
    assert torch.equal(back[0].features, batch[:3]) and torch.equal(back[1].features, batch[3:])


def test_decode_takes_protobufs_own_layout_too():
    """Any valid encoding decodes: protobuf's (tensor last), no tensor at all, or a broken layout is left to
    protobuf (which then raises its own error)."""
    t = torch.randn(2, 3)
    reference = prefill_output_to_proto(PrefillOutput("r", 7, t, RUNNING))
    msg, raw = decode_with_tensor(target_pb2.PrefillResponse, reference.SerializeToString(), "features")
    assert msg.request_id == "r" and _raw_equals(raw, t)
    plain = target_pb2.PrefillResponse(request_id="s", first_token=1).SerializeToString()
    assert decode_with_tensor(target_pb2.PrefillResponse, plain, "features") == \
        (target_pb2.PrefillResponse.FromString(plain), None)
    with pytest.raises(DecodeError):
        decode_with_tensor(target_pb2.PrefillResponse, b"\x1a\xff\xff", "features")


def test_garbage_decodes_or_raises_decode_error_only():
    """Whatever a broken target sends, decoding gives a message or protobuf's DecodeError, nothing else (the
    client turns that into MalformedReply)."""
    rng = random.Random(0)
    good = verify_reply_bytes([VerifyOutput("a", [1, 2], 1, torch.randn(2, 4))])
    samples = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(1500)]
    for _ in range(1500):  # a valid reply with a few bytes changed or cut
        b = bytearray(good)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        samples.append(bytes(b[: rng.randrange(1, len(b) + 1)]))
    for data in samples:
        try:
            msg, raw = decode_with_tensor(target_pb2.VerifyResponse, data, "features")
        except DecodeError:
            continue
        assert isinstance(msg, target_pb2.VerifyResponse) and (raw is None or isinstance(raw, RawTensor))
