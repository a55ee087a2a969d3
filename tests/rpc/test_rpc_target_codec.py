"""target_codec: Verify replies carry the batch's features as one blob and unpack to the same rows; the engine
thread moves features to host memory in one copy per feature width before the reply is packed."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.requests import RUNNING, STOP, VerifyOutput
from specdec.errors import InvalidInput
from specdec.rpc.target_codec import (
    features_to_host,
    rows_of_one,
    verify_from_proto,
    verify_outputs_from_proto,
    verify_outputs_to_proto,
)
from specdec.rpc.tensor_codec import tensor_to_proto
from specdec.v1 import common_pb2, target_pb2


def test_verify_reply_round_trip_keeps_each_requests_rows():
    feats = [torch.randn(3, 8).to(torch.bfloat16), torch.randn(1, 8).to(torch.bfloat16)]
    outs = [VerifyOutput("a", [1, 2, 3], 2, feats[0]), VerifyOutput("b", [4], 0, feats[1]),
            VerifyOutput("c", [5, 6], 1, None, STOP)]
    msg = target_pb2.VerifyResponse.FromString(verify_outputs_to_proto(outs).SerializeToString())
    back = verify_outputs_from_proto(msg)
    assert [(o.request_id, o.tokens, o.num_accepted_drafts, o.finish_reason) for o in back] == \
        [("a", [1, 2, 3], 2, RUNNING), ("b", [4], 0, RUNNING), ("c", [5, 6], 1, STOP)]
    assert torch.equal(back[0].features, feats[0]) and torch.equal(back[1].features, feats[1])
    assert back[2].features is None


def test_tensor_fills_a_replys_field_in_place():
    t = torch.randn(4, 6)
    reply = target_pb2.PrefillResponse()
    tensor_to_proto(t, reply.features)
    assert reply.features == tensor_to_proto(t)
    tensor_to_proto(torch.randn(2, 3), reply.features)  # refilled, not appended
    assert list(reply.features.shape) == [2, 3] and isinstance(reply.features, common_pb2.Tensor)


def test_host_features_are_left_as_they_are():
    """(The device-to-host copy itself is checked on a GPU: tests/gpu/test_gpu_paths.py.)"""
    f = torch.randn(2, 8)
    outs = [VerifyOutput("a", [1, 2], 1, f), VerifyOutput("b", [3], 0, None, STOP)]
    assert features_to_host(outs) is outs and outs[0].features is f and outs[1].features is None


def test_rows_of_one_tensor_stack_without_a_copy():
    batch = torch.randn(9, 4)
    views = list(batch.split([3, 1, 5]))
    stacked = rows_of_one(views)
    assert torch.equal(stacked, batch) and stacked.data_ptr() == batch.data_ptr()  # a view, no copy
    assert torch.equal(rows_of_one(views[:2]), batch[:4])
    # not consecutive (a request skipped, rows cut short, another tensor): copied, same values
    for parts in ([views[0], views[2]], [views[0][:2], views[1]], [views[0], torch.randn(2, 4)], [batch.t()[:2]]):
        got = rows_of_one(parts)
        assert torch.equal(got, torch.cat(parts))
    one = torch.randn(1, 4)
    assert rows_of_one([one]) is one or torch.equal(rows_of_one([one]), one)


def test_a_traced_prefill_encodes_with_its_feature_wire():
    """The sixth positional field of PrefillInput stays the trace context (the scheduler passes it so); the wire
    format asked for travels as PrefillRequest.feature_dtype and back."""
    from specdec.engine.requests import PrefillInput
    from specdec.rpc.target_codec import prefill_from_proto, prefill_to_proto
    from specdec.rpc.tensor_codec import FP8_ROWS
    from specdec.sampling_params import SamplingParams

    ctx = object()
    inp = PrefillInput("r", [1, 2], SamplingParams(), (), True, ctx)
    assert inp.trace_context is ctx and inp.feature_wire == ""
    assert prefill_to_proto(inp).feature_dtype == ""
    msg = prefill_to_proto(PrefillInput("r", [1, 2], SamplingParams(), trace_context=ctx, feature_wire=FP8_ROWS))
    assert prefill_from_proto(msg).feature_wire == FP8_ROWS


def test_verify_plain_steps_are_checked_in_the_wires_range():
    """0 (proto3's unset) is one step; the refusal names the range the wire accepts, [0, 64], not the engine's."""
    tree = [target_pb2.TreeProposal(request_id="r")]
    assert verify_from_proto(target_pb2.VerifyRequest(trees=tree))[1] == 1
    assert verify_from_proto(target_pb2.VerifyRequest(trees=tree, plain_steps=64))[1] == 64
    for bad in (-1, 65):
        with pytest.raises(InvalidInput, match=rf"plain_steps {bad} outside \[0, 64\] \(0: one step\)"):
            verify_from_proto(target_pb2.VerifyRequest(trees=tree, plain_steps=bad))
