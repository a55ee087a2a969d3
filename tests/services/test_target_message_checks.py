"""The target servicer's checks on a message before it reads it, and a long Prefill whose caller leaves during its
last part (QA): the servicer driven on a real tiny engine through a loop that runs each call at once.

- A Verify naming more requests than the target could hold (a KV page each), or a Prefill longer than the context,
  is refused with INVALID_ARGUMENT before its trees or ids are read: reading two million empty trees took ~15 s on
  the event loop every other call waits on.
- A caller that leaves while the last part of its prompt runs gets its request released, its pages freed, as one
  that leaves between parts does (before, the request stayed running, its pages held until its idle time ran out)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from repo_paths import TINY

from specdec.engine.factory import EngineOptions, build_target
from specdec.errors import InvalidInput
from specdec.v1 import common_pb2, target_pb2
from target_service.servicer import TargetServicer


class _Loop:
    """Runs each engine call at once; `leave_after` (a method name): the caller leaves as that call returns."""

    def __init__(self, leave_after: str = ""):
        self.leave_after, self.calls = leave_after, []

    async def call(self, fn, *args):
        out = fn(*args)
        self.calls.append(fn.__name__)
        if fn.__name__ == self.leave_after and out is not None:
            raise asyncio.CancelledError
        return out

    async def call_batched(self, fn, item, *_):
        return fn([item])[0]


@pytest.fixture(scope="module")
def engine():
    return build_target(str(TINY / "target"), EngineOptions(num_pages=256, max_batch_size=4))


@pytest.fixture
def target(engine):
    yield engine
    engine.prefill_chunk_tokens = 0
    for rid in list(engine.requests):
        engine.release(rid)


def _prefill(rid: str, ids: list[int]) -> target_pb2.PrefillRequest:
    return target_pb2.PrefillRequest(request_id=rid, prompt_ids=ids,
                                     sampling=common_pb2.SamplingParams(max_new_tokens=8, ignore_eos=True))


def test_a_verify_of_more_trees_than_pages_is_refused_before_it_is_read(target):
    servicer = TargetServicer(target, _Loop(), "tiny")
    pages = target.kv.num_total_pages
    msg = target_pb2.VerifyRequest(trees=[target_pb2.TreeProposal(request_id=f"r{i}") for i in range(pages + 1)])
    with pytest.raises(InvalidInput, match=f"names {pages + 1} requests; this target holds at most {pages}"):
        target.check_verify_size(len(msg.trees))
    ctx = _Context()
    asyncio.run(servicer.Verify(msg, ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and f"at most {pages}" in ctx.details


def test_a_prompt_past_the_context_is_refused_on_its_length(target):
    servicer = TargetServicer(target, _Loop(), "tiny")
    ctx = _Context()
    asyncio.run(servicer.Prefill(_prefill("long", [5] * target.max_context), ctx))
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT
    assert ctx.details.startswith(f"prompt has {target.max_context} tokens; the context length is")
    assert not target.requests


@pytest.mark.parametrize("leave_after", ["_prefill_part", "begin_prefill"])
def test_a_caller_that_leaves_a_prefill_in_parts_frees_its_pages(target, leave_after):
    target.prefill_chunk_tokens = 32
    free = target.kv.pool.num_free
    loop = _Loop(leave_after)
    servicer = TargetServicer(target, loop, "tiny")
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(servicer._prefill_in_parts(_prefill_from(target, "gone", 100)))
    if leave_after == "_prefill_part":
        assert loop.calls.count("_prefill_part") == 4  # 100 tokens in parts of 32: it left as the last one ran
    assert "gone" not in target.requests and not target.prefilling
    assert target.kv.pool.num_free == free


def test_a_drop_leaves_a_later_request_under_the_same_id_alone(target):
    target.prefill_chunk_tokens = 32
    servicer = TargetServicer(target, _Loop(), "tiny")
    first = target.begin_prefill(_prefill_from(target, "r", 100))
    target.release("r")
    target.begin_prefill(_prefill_from(target, "r", 100))
    servicer._drop_parts(_prefill_from(target, "r", 100), first)
    assert "r" in target.requests and "r" in target.prefilling


def _prefill_from(target, rid: str, n: int):
    from specdec.rpc.target_codec import prefill_from_proto

    return prefill_from_proto(_prefill(rid, [(7 * i + 3) % 500 + 10 for i in range(n)]))


class _Context:
    """What the servicer's error mapping sets on a grpc.aio ServicerContext."""

    code, details = None, ""

    def set_code(self, code):
        self.code = code

    def set_details(self, details):
        self.details = details
