"""TargetService messages <-> engine dataclasses, both ways: the target servicer decodes what the draft's client
encodes, so each conversion is written once here."""

from __future__ import annotations

import torch

from specdec.engine.plain_steps import MAX_PLAIN_STEPS
from specdec.engine.requests import ABORT, LENGTH, RUNNING, STOP, PrefillInput, PrefillOutput, VerifyInput, VerifyOutput
from specdec.errors import InvalidInput
from specdec.request_ids import check_not_reserved
from specdec.rpc.sampling_codec import sampling_from_proto, sampling_to_proto
from specdec.rpc.tensor_codec import FEATURE_DTYPES, pack_fp8_rows, tensor_from_proto, tensor_to_proto
from specdec.rpc.wire import encode_with_tensor
from specdec.v1 import common_pb2, target_pb2

_FINISH_TO_PROTO = {
    RUNNING: common_pb2.FINISH_REASON_UNSPECIFIED,
    STOP: common_pb2.FINISH_REASON_STOP,
    LENGTH: common_pb2.FINISH_REASON_LENGTH,
    ABORT: common_pb2.FINISH_REASON_ABORT,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}
MAX_REQUEST_ID_LEN = 256


def finish_to_proto(reason: str) -> int:
    return _FINISH_TO_PROTO[reason]


def finish_from_proto(value: int) -> str:
    return _FINISH_FROM_PROTO.get(value, ABORT)


def check_request_id(rid: str, chosen_by_client: bool = False) -> str:
    """`chosen_by_client`: a Generate's id, which must not take the warm-up prefix (`specdec.request_ids`). The
    draft-to-target calls (Prefill, Verify, Release) keep the default: the warm-up itself goes through them."""
    if not rid:
        raise InvalidInput("request_id is empty")
    if len(rid) > MAX_REQUEST_ID_LEN:
        raise InvalidInput(f"request_id longer than {MAX_REQUEST_ID_LEN} characters")
    return check_not_reserved(rid) if chosen_by_client else rid


# ---- Prefill ---------------------------------------------------------------------------------------------
def prefill_to_proto(inp: PrefillInput) -> target_pb2.PrefillRequest:
    return target_pb2.PrefillRequest(
        request_id=inp.request_id, prompt_ids=inp.prompt_ids, sampling=sampling_to_proto(inp.sampling),
        feature_layer_ids=list(inp.feature_layers), return_features=inp.return_features,
        feature_dtype=inp.feature_wire, feature_rows=inp.feature_rows, queue_for_pages=inp.queue_for_pages,
    )


def prefill_from_proto(msg: target_pb2.PrefillRequest) -> PrefillInput:
    sampling = sampling_from_proto(msg.sampling if msg.HasField("sampling") else None)
    if msg.feature_dtype not in FEATURE_DTYPES:
        raise InvalidInput(f"feature_dtype {msg.feature_dtype!r} is not one of {list(FEATURE_DTYPES)}")
    return PrefillInput(check_request_id(msg.request_id), list(msg.prompt_ids), sampling,
                        tuple(msg.feature_layer_ids), msg.return_features, feature_wire=msg.feature_dtype,
                        feature_rows=msg.feature_rows, queue_for_pages=msg.queue_for_pages)


def prefill_output_to_proto(out: PrefillOutput) -> target_pb2.PrefillResponse:
    msg = _prefill_reply(out)
    if out.features is not None:
        tensor_to_proto(out.features, msg.features)
    return msg


def prefill_reply_bytes(out: PrefillOutput) -> bytes:
    """`prefill_output_to_proto(out)` encoded, the features' bytes copied once (see specdec.rpc.wire)."""
    return encode_with_tensor(_prefill_reply(out), "features", out.features)


def _prefill_reply(out: PrefillOutput) -> target_pb2.PrefillResponse:
    return target_pb2.PrefillResponse(request_id=out.request_id, first_token=out.first_token,
                                      finish_reason=finish_to_proto(out.finish_reason))


def prefill_output_from_proto(msg: target_pb2.PrefillResponse, device=None, features=None,
                              expected_dim: int | None = None, expected_rows: int | None = None) -> PrefillOutput:
    """`features`: the reply's tensor when read apart from `msg` (see specdec.rpc.wire.decode_with_tensor);
    `expected_*`: checks of its shape (InvalidInput), as `tensor_from_proto` makes them."""
    features = features if features is not None else msg.features if msg.HasField("features") else None
    feats = None if features is None else tensor_from_proto(features, device, expected_dim, expected_rows)
    return PrefillOutput(msg.request_id, msg.first_token, feats, finish_from_proto(msg.finish_reason))


# ---- Verify ----------------------------------------------------------------------------------------------
def verify_to_proto(inputs: list[VerifyInput], plain_steps: int = 1, feature_rows: int = 0) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(trees=[
        target_pb2.TreeProposal(request_id=i.request_id, draft_tokens=i.draft_tokens, parents=i.parents,
                                num_generated=i.num_generated)
        for i in inputs
    ], plain_steps=plain_steps if plain_steps != 1 else 0, feature_rows=feature_rows)


def verify_from_proto(msg: target_pb2.VerifyRequest) -> tuple[list[VerifyInput], int, int]:
    """(the trees, the plain steps asked for: 0 means 1, the feature rows asked for: 0 means all); both counts are
    checked by the engine."""
    inputs = [VerifyInput(check_request_id(t.request_id), list(t.draft_tokens), list(t.parents), t.num_generated)
              for t in msg.trees]
    return inputs, _plain_steps(msg.plain_steps), msg.feature_rows


def _plain_steps(steps: int) -> int:
    """The wire's count as the engine's: 0 (proto3's unset) is one step. Checked here, in the wire's own range:
    the engine's check would name [1, 64] for a -1 the caller sent while 0 is accepted."""
    if not 0 <= steps <= MAX_PLAIN_STEPS:
        raise InvalidInput(f"plain_steps {steps} outside [0, {MAX_PLAIN_STEPS}] (0: one step)")
    return steps or 1


def verify_outputs_to_proto(outputs: list[VerifyOutput]) -> target_pb2.VerifyResponse:
    msg, feats = _verify_reply(outputs)
    if feats:
        tensor_to_proto(rows_of_one(feats), msg.features)
    return msg


def verify_reply_bytes(outputs: list[VerifyOutput]) -> bytes:
    """`verify_outputs_to_proto(outputs)` encoded, the features' bytes copied once (see specdec.rpc.wire)."""
    msg, feats = _verify_reply(outputs)
    return encode_with_tensor(msg, "features", rows_of_one(feats) if feats else None)


def _verify_reply(outputs: list[VerifyOutput]) -> tuple[target_pb2.VerifyResponse, list[torch.Tensor]]:
    """The reply without its features, and the feature rows it carries (running requests', in order)."""
    msg = target_pb2.VerifyResponse()
    feats = []
    for out in outputs:
        rows = 0 if out.finish_reason != RUNNING or out.features is None else out.features.shape[0]
        if rows:
            feats.append(out.features)
        msg.results.append(target_pb2.VerifyResult(
            request_id=out.request_id, tokens=out.tokens, num_accepted_drafts=out.num_accepted_drafts,
            num_feature_rows=rows, finish_reason=finish_to_proto(out.finish_reason)))
    return msg, feats


def rows_of_one(tensors: list[torch.Tensor]) -> torch.Tensor:
    """`tensors` stacked by rows: without a copy when they are consecutive rows of one contiguous tensor (as
    `features_to_host` leaves a batch's features), else one `torch.cat`."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() != offset):
            return torch.cat(tensors) if len(tensors) > 1 else first
        offset += t.numel()
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return first.as_strided(shape, strides, first.storage_offset())


def verify_outputs_from_proto(msg: target_pb2.VerifyResponse, device=None, features=None,
                              expected_dim: int | None = None) -> list[VerifyOutput]:
    """`features`: the reply's tensor when read apart from `msg` (see specdec.rpc.wire.decode_with_tensor);
    `expected_dim`: a check of its width (InvalidInput); its rows are checked against the results'."""
    total = sum(r.num_feature_rows for r in msg.results)
    features = features if features is not None else msg.features
    feats = tensor_from_proto(features, device, expected_dim, expected_rows=total) if total else None
    outputs, start = [], 0
    for r in msg.results:
        rows = feats[start : start + r.num_feature_rows] if r.num_feature_rows else None
        start += r.num_feature_rows
        outputs.append(VerifyOutput(r.request_id, list(r.tokens), r.num_accepted_drafts, rows,
                                    finish_from_proto(r.finish_reason)))
    return outputs


def features_to_host(outputs: list, packed: frozenset | set = frozenset()) -> list:
    """Move the features of Prefill/Verify outputs to host memory, one device-to-host copy per feature width.
    Call it on the engine thread: the copy waits for the GPU, and the event loop that packs the reply (and
    answers every other RPC) must not; with two micro-batches in flight it would also wait for the next
    micro-batch's forward queued behind it. Outputs of the request ids in `packed` travel as 8-bit floats with a
    scale per row (`pack_fp8_rows`, done on the device before the copy: half the bytes to copy and send)."""
    groups: dict[tuple, list] = {}
    for out in outputs:
        f = out.features
        pack = out.request_id in packed
        if f is not None and (pack or f.device.type != "cpu"):
            groups.setdefault((f.dtype, tuple(f.shape[1:]), pack), []).append(out)
    for (_, _, pack), group in groups.items():
        rows = rows_of_one([o.features for o in group])  # a verify's features: one tensor's rows, no copy
        host = _to_host(pack_fp8_rows(rows) if pack else rows)
        for out, part in zip(group, host.split([o.features.shape[0] for o in group]), strict=True):
            out.features = part
    return outputs


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """`t.cpu()`; from a GPU into pinned memory (torch's host cache: no new allocation once warm), about twice
    as fast as a copy into pageable memory for the MBs a large batch's features take."""
    if t.device.type != "cuda":
        return t.cpu()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host
