"""Prefill RPCs that reach the target together run as one forward; a bad one fails alone (its own status, the
others' replies unchanged, no pages left behind)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from repo_paths import TINY

from specdec.engine.factory import EngineOptions, build_target
from specdec.engine.requests import PrefillInput, VerifyInput
from specdec.sampling_params import SamplingParams
from specdec.serving.engine_loop import EngineLoop
from specdec.v1 import target_pb2
from target_service.servicer import TargetServicer


class Aborted(Exception):
    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


class FakeContext:
    """A call's status, as the servicer sets it when it refuses the call (`specdec.rpc.errors.end_call`)."""

    code = message = None

    def set_code(self, code):
        self.code = code

    def set_details(self, message):
        self.message = message


@pytest.fixture
def target():
    engine = build_target(str(TINY / "target"), EngineOptions(num_pages=256, max_batch_size=8))
    batches: list[list[str]] = []
    prefill = engine.prefill

    def recorded(inputs):
        batches.append([i.request_id for i in inputs])
        return prefill(inputs)

    engine.prefill = recorded
    return engine, batches


def _request(rid: str, prompt: list[int]) -> target_pb2.PrefillRequest:
    return target_pb2.PrefillRequest(request_id=rid, prompt_ids=prompt, return_features=True)


async def _together(servicer: TargetServicer, loop: EngineLoop, requests: list) -> list:
    """All requests queued before the engine thread starts, so they meet in one batch."""
    replies = await _calls(servicer.Prefill, loop, requests)
    return [r if isinstance(r, Aborted) else target_pb2.PrefillResponse.FromString(r) for r in replies]


async def _calls(method, loop: EngineLoop, requests: list) -> list:
    """Each request's encoded reply, or Aborted with the status the servicer set (it returns None then)."""
    contexts = [FakeContext() for _ in requests]
    tasks = [asyncio.ensure_future(method(r, c)) for r, c in zip(requests, contexts, strict=True)]
    await asyncio.sleep(0.05)
    loop.start()
    replies = await asyncio.gather(*tasks)
    return [Aborted(c.code, c.message) if r is None else r for r, c in zip(replies, contexts, strict=True)]


def test_prefills_arriving_together_run_as_one_forward(target):
    engine, batches = target
    prompts = [list(range(10 + i, 30 + 3 * i)) for i in range(5)]
    loop = EngineLoop(None, "target-engine")
    servicer = TargetServicer(engine, loop, "tiny")
    try:
        replies = asyncio.run(_together(servicer, loop, [_request(f"r{i}", p) for i, p in enumerate(prompts)]))
    finally:
        loop.stop()
    assert batches == [[f"r{i}" for i in range(5)]]
    for i, (reply, prompt) in enumerate(zip(replies, prompts, strict=True)):
        assert reply.request_id == f"r{i}" and list(reply.features.shape)[0] == len(prompt)
        engine.release(f"r{i}")
        alone = engine.prefill([engine_input(f"alone{i}", prompt)])[0]
        engine.release(f"alone{i}")
        assert reply.first_token == alone.first_token
        got = torch.frombuffer(bytearray(reply.features.data), dtype=torch.float32).view(len(prompt), -1)
        torch.testing.assert_close(got, alone.features, rtol=1e-4, atol=1e-4)
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_a_bad_prefill_among_others_fails_alone(target):
    engine, batches = target
    engine.prefill([engine_input("dup", [5, 6, 7])])
    loop = EngineLoop(None, "target-engine")
    servicer = TargetServicer(engine, loop, "tiny")
    requests = [_request("a", [5, 6, 7, 8]), _request("dup", [9, 9]), _request("b", [1, 2, 3]),
                _request("c", [4] * 40)]
    try:
        replies = asyncio.run(_together(servicer, loop, requests))
    finally:
        loop.stop()
    assert isinstance(replies[1], Aborted) and replies[1].code == grpc.StatusCode.ALREADY_EXISTS
    assert [r.request_id for i, r in enumerate(replies) if i != 1] == ["a", "b", "c"]
    assert batches[1] == ["a", "dup", "b", "c"]  # the batch was refused whole, then each ran alone
    assert sorted(engine.requests) == ["a", "b", "c", "dup"]
    for rid in ("a", "b", "c", "dup"):
        engine.release(rid)
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def engine_input(rid: str, prompt: list[int]) -> PrefillInput:
    return PrefillInput(rid, prompt, SamplingParams())


def test_fp8_features_only_for_the_requests_that_asked_and_verify_batches_that_all_did(target):
    """Prefills that meet in one forward: only the one asking for 8-bit features gets them. A Verify batch is sent in
    8 bits only when every request in it asked (the reply is one blob); a mixed batch gets the compute dtype."""
    from specdec.rpc.tensor_codec import FP8_ROWS

    engine, _ = target
    loop = EngineLoop(None, "target-engine")
    servicer = TargetServicer(engine, loop, "tiny")
    fp8 = target_pb2.PrefillRequest(request_id="q", prompt_ids=[5, 6, 7], return_features=True,
                                    feature_dtype=FP8_ROWS)
    try:
        replies = asyncio.run(_together(servicer, loop, [_request("n", [5, 6, 7, 8]), fp8]))
    finally:
        loop.stop()
    assert [r.features.dtype for r in replies] == ["float32", FP8_ROWS]
    inputs = lambda *rids: [VerifyInput(r, [], []) for r in rids]  # noqa: E731
    assert servicer._packed(inputs("q")) == {"q"} and servicer._packed(inputs("q", "n")) == frozenset()
    for rid in ("n", "q"):
        engine.release(rid)


def test_verify_calls_of_the_same_requests_arriving_together_run_in_order(target):
    """A draft's pipelined plain calls: the second names the requests of the first and continues where it ends.
    Met in one batch, they run one after the other in arrival order (never as one forward), and a request the first
    finished gets an empty result with its finish reason."""
    from specdec.engine.requests import PrefillInput as Prefill

    engine, _ = target
    params = {"a": SamplingParams(max_new_tokens=30, ignore_eos=True),
              "b": SamplingParams(max_new_tokens=3, ignore_eos=True)}
    prompt = list(range(40, 70))
    engine.prefill([Prefill(rid, prompt, p) for rid, p in params.items()])
    ref = {rid: [] for rid in params}
    while engine.requests.keys() & params.keys():
        for out in engine.verify([VerifyInput(r, [], []) for r in params if r in engine.requests]):
            ref[out.request_id] += out.tokens
    engine.prefill([Prefill(rid, prompt, p) for rid, p in params.items()])

    def plain_call(*rids):
        return target_pb2.VerifyRequest(trees=[target_pb2.TreeProposal(request_id=r) for r in rids], plain_steps=4,
                                        feature_rows=1)

    async def together():
        tasks = [asyncio.ensure_future(servicer.Verify(plain_call("a", "b"), FakeContext())) for _ in range(3)]
        await asyncio.sleep(0.05)
        loop.start()
        return [target_pb2.VerifyResponse.FromString(r) for r in await asyncio.gather(*tasks)]

    class Recorded:  # what the metrics see: one batch and one forward per engine forward (QA: 2 calls read as one
        def __init__(self):  # forward of batch 2 when a draft's two pipelined calls of one request met)
            self.batches, self.phases = [], []

        def observe_batch(self, n):
            self.batches.append(n)

        def observe_phase(self, phase, seconds):
            self.phases.append(phase)

    loop = EngineLoop(None, "target-engine")
    metrics = Recorded()
    servicer = TargetServicer(engine, loop, "tiny", metrics)
    try:
        replies = asyncio.run(together())
    finally:
        loop.stop()
    assert metrics.batches == [2, 2, 2] and metrics.phases.count("forward") == 3
    assert metrics.phases.count("queue") == 3
    got = [[list(r.tokens) for r in reply.results] for reply in replies]
    assert [t for call in got for t in call[0]] == ref["a"][:12]
    assert got[0][1] == ref["b"] and got[1][1] == got[2][1] == []
    assert [r.results[1].finish_reason for r in replies] == [replies[0].results[1].finish_reason] * 3
    engine.release("a")
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_a_refused_verify_beside_others_fails_alone_and_runs_nothing_twice(target):
    """Verify RPCs meeting in one batch, in arrival order: plain calls of a and b (they run and commit), then a call
    of a continuing from a count the target has not reached (a pipelined call that overtook the one before it:
    ABORTED, nothing committed) and one naming an unknown id (NOT_FOUND). The refused ones fail alone; the calls
    that ran keep their tokens. Before, the refusal made the engine loop run the whole batch again one call at a
    time: a's call ran a second time on the tokens it had committed (now refused as out of order: its tokens lost)."""
    engine, _ = target
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    prompt = list(range(40, 70))
    engine.prefill([PrefillInput(rid, prompt, params, return_features=False) for rid in ("a", "b", "ref")])
    ref = engine.verify([VerifyInput("ref", [], [], num_generated=1)], plain_steps=8)[0].tokens
    engine.release("ref")

    def plain_call(rid, num_generated):
        return target_pb2.VerifyRequest(trees=[target_pb2.TreeProposal(request_id=rid, num_generated=num_generated)],
                                        plain_steps=4)

    calls = [plain_call("a", 1), plain_call("b", 1), plain_call("a", 9), plain_call("nope", 1)]

    class Batches:  # the batch sizes the metrics see: refused calls ran no forward (QA: they were counted)
        sizes: list[int] = []

        def observe_batch(self, n):
            self.sizes.append(n)

        def observe_phase(self, phase, seconds):
            pass

    loop = EngineLoop(None, "target-engine")
    metrics = Batches()
    servicer = TargetServicer(engine, loop, "tiny", metrics)
    try:
        a, b, overtaking, unknown = asyncio.run(_calls(servicer.Verify, loop, calls))
    finally:
        loop.stop()
    assert list(target_pb2.VerifyResponse.FromString(a).results[0].tokens) == ref[:4]
    assert list(target_pb2.VerifyResponse.FromString(b).results[0].tokens) == ref[:4]
    assert isinstance(overtaking, Aborted) and overtaking.code == grpc.StatusCode.ABORTED
    assert "has generated 5 tokens; the call continues from 9" in str(overtaking)
    assert isinstance(unknown, Aborted) and unknown.code == grpc.StatusCode.NOT_FOUND
    assert engine.requests["a"].num_generated == engine.requests["b"].num_generated == 5  # each ran once
    assert metrics.sizes == [2]
    for rid in ("a", "b"):
        engine.release(rid)
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def _first_tokens_as_alone(engine, replies, prompts, prefix: str) -> None:
    """Each reply (request `<prefix><i>`, released here) has the first token of its prompt prefilled alone, and every
    page is free after."""
    for r, (reply, prompt) in enumerate(zip(replies, prompts, strict=True)):
        engine.release(f"{prefix}{r}")
        alone = engine.prefill([engine_input(f"alone{r}", prompt)])[0]
        engine.release(f"alone{r}")
        assert reply.first_token == alone.first_token
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def _counted_rounds(engine, chunk: int = 64):
    """(loop, servicer, the calls of each round of the engine thread), with parts of `chunk` tokens."""
    engine.prefill_chunk_tokens = chunk
    loop = EngineLoop(None, "target-engine")
    servicer = TargetServicer(engine, loop, "tiny")
    calls_per_round = []
    run_calls = loop._run_calls

    def counted(calls):
        calls_per_round.append(list(calls))
        run_calls(calls)

    loop._run_calls = counted
    return loop, servicer, calls_per_round


def test_long_prompts_in_parts_take_turns_a_part_per_round(target):
    """Prompts longer than `prefill_chunk_tokens` arriving together: each engine round runs at most one part (QA: four
    admitted together put four parts in a round, past a 2 s stall limit on a CPU), and each reply equals the prompt's
    prefill in one forward."""
    engine, _ = target
    loop, servicer, calls_per_round = _counted_rounds(engine)
    prompts = [[(7 * i + 3 * r) % 8000 + 10 for i in range(200 + 30 * r)] for r in range(3)]
    try:
        replies = asyncio.run(_together(servicer, loop, [_request(f"p{r}", p) for r, p in enumerate(prompts)]))
    finally:
        loop.stop()
    parts_per_round = [sum(getattr(c.fn, "__func__", None) is TargetServicer._prefill_part for c in calls)
                       for calls in calls_per_round]
    assert max(parts_per_round) == 1 and sum(parts_per_round) == 4 + 4 + 5  # 200, 230, 260 tokens in parts of 64
    engine.prefill_chunk_tokens = 0
    _first_tokens_as_alone(engine, replies, prompts, "p")


def test_a_burst_of_short_prompts_runs_a_part_worth_a_round(target):
    """Short Prefill RPCs arriving together run in rounds of at most `prefill_chunk_tokens` prompt tokens (one
    forward each), so calls that arrive meanwhile (running streams' Verify RPCs) wait for one part's worth at most;
    each reply equals the prompt's prefill alone."""
    engine, batches = target
    loop, servicer, calls_per_round = _counted_rounds(engine)
    prompts = [[(11 * i + r) % 8000 + 10 for i in range(20 + 5 * r)] for r in range(5)]  # 20, 25, 30, 35, 40
    try:
        replies = asyncio.run(_together(servicer, loop, [_request(f"s{r}", p) for r, p in enumerate(prompts)]))
    finally:
        loop.stop()
    assert batches == [["s0", "s1"], ["s2"], ["s3"], ["s4"]]  # 45, 30, 35, 40 tokens
    assert len(calls_per_round) == 4  # a forward a round
    _first_tokens_as_alone(engine, replies, prompts, "s")
