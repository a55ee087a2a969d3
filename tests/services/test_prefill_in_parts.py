"""A long prompt through the real services with `--prefill-chunk-tokens`: the target runs Verify calls between its
parts, a draft admits it while its running stream goes on, the text is the target's own, a Prefill cancelled mid-way
leaves nothing held. The target's own `Generate` and a draft with its target in-process run it a part per step:
their running streams go on too."""

from __future__ import annotations

import asyncio
import time

import pytest
from services_stack import start_draft, start_target

from draft_service.target_client import TargetClient
from specdec.engine.requests import PrefillInput, VerifyInput
from specdec.errors import Cancelled
from specdec.rpc.channel import make_channel
from specdec.sampling_params import SamplingParams
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

CHUNK = 32


@pytest.fixture(scope="module")
def stack():
    target = start_target("--num-pages", "600", "--prefill-chunk-tokens", str(CHUNK))
    draft = start_draft(target.addr, "--num-steps", "4", "--num-draft-tokens", "4")
    yield target, draft
    draft.stop()
    target.stop()


@pytest.fixture(scope="module")
def long_prompt(dev_prompts, tiny_tokenizer):
    ids = [t for p in dev_prompts[:40] for t in tiny_tokenizer.encode(p)]
    return ids[:1500]


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


def test_verify_calls_run_between_the_parts_and_a_cancel_frees_the_pages(stack, long_prompt):
    target, _ = stack
    client = TargetClient(target.addr, timeout_s=30.0, features=True)
    try:
        info = client.model_info()
        assert info.prefill_chunk_tokens == CHUNK
        free0 = info.kv.pages_free
        client.prefill([PrefillInput("run", long_prompt[:20], _params(500))])
        sent = client.prefill_send([PrefillInput("long", long_prompt, _params(8))])
        verifies = 0
        while not client.prefill_ready(sent):
            client.verify([VerifyInput("run", [], [])])
            verifies += 1
        out = client.prefill_collect(sent)[0]
        assert verifies >= 3, verifies  # ~47 parts: the running request's calls went between them
        assert out.features.shape[0] == len(long_prompt)
        client.release("long")

        sent = client.prefill_send([PrefillInput("gone", long_prompt, _params(8))])
        time.sleep(0.05)  # some parts in
        client.cancel_prefill("gone")
        assert isinstance(client.prefill_collect(sent)[0], Cancelled)
        client.release("run")
        deadline = time.monotonic() + 5
        while (info := client.model_info()).num_running and time.monotonic() < deadline:
            time.sleep(0.05)  # the release of the cancelled prefill runs after its part under way
        assert info.num_running == 0 and info.kv.pages_free == free0
    finally:
        client.close()


async def _stream(stub, rid, prompt, n, arrivals: list):
    """A Generate stream through a draft's or a target's stub; `arrivals` gets (time, tokens so far) per message."""
    kind = (target_pb2.TargetServiceGenerateRequest if isinstance(stub, target_pb2_grpc.TargetServiceStub)
            else draft_pb2.DraftServiceGenerateRequest)
    tokens = []
    sampling = common_pb2.SamplingParams(max_new_tokens=n, ignore_eos=True)
    async for msg in stub.Generate(kind(request_id=rid, prompt_ids=prompt, sampling=sampling)):
        tokens += list(msg.token_ids)
        arrivals.append((time.monotonic(), len(tokens)))
    return tokens


async def _during(stub, tag: str, long_prompt: list[int]) -> tuple[list, list, float, list, list]:
    """Stream "<tag>a" (a short prompt, 400 tokens) through `stub`; once it streams, "<tag>b" (the long prompt, 16
    tokens). -> a's tokens, its arrivals, when b was sent, b's tokens and arrivals."""
    a_times, b_times = [], []
    a = asyncio.ensure_future(_stream(stub, f"{tag}a", long_prompt[:30], 400, a_times))
    while not a_times:
        await asyncio.sleep(0.005)
    b_sent = time.monotonic()
    b = await _stream(stub, f"{tag}b", long_prompt, 16, b_times)
    return await a, a_times, b_sent, b, b_times


def _streamed_meanwhile(a_times, b_sent, b_times) -> int:
    return len([n for t, n in a_times if b_sent < t < b_times[0][0]])


def test_the_targets_own_generate_streams_on_while_a_long_prompt_is_admitted(stack, long_prompt):
    target, draft = stack

    async def run():
        async with make_channel(target.addr) as tch, make_channel(draft.addr) as dch:
            t = target_pb2_grpc.TargetServiceStub(tch)
            got = await _during(t, "g", long_prompt)
            spec = await _stream(draft_pb2_grpc.DraftServiceStub(dch), "spec-b", long_prompt, 16, [])
            return got, spec

    (a_tokens, a_times, b_sent, b, b_times), spec = asyncio.run(run())
    assert _streamed_meanwhile(a_times, b_sent, b_times) >= 10  # 47 parts, a step between two (one forward: 1-2)
    assert len(a_tokens) == 400 and b == spec


def test_a_colocated_draft_streams_on_while_a_long_prompt_is_admitted(stack, long_prompt):
    target, _ = stack
    colocated = start_draft("in-process", "--num-pages", "600",
                            "--prefill-chunk-tokens", str(CHUNK), "--num-steps", "4", "--num-draft-tokens", "4")
    try:
        async def run():
            async with make_channel(colocated.addr) as ch, make_channel(target.addr) as tch:
                d = draft_pb2_grpc.DraftServiceStub(ch)
                got = await _during(d, "c", long_prompt)
                plain = await _stream(target_pb2_grpc.TargetServiceStub(tch), "plain-cb", long_prompt, 16, [])
                info = await target_pb2_grpc.TargetServiceStub(ch).GetModelInfo(
                    target_pb2.TargetServiceGetModelInfoRequest())
                return got, plain, info

        (a_tokens, a_times, b_sent, b, b_times), plain, info = asyncio.run(run())
    finally:
        colocated.stop()
    assert _streamed_meanwhile(a_times, b_sent, b_times) >= 10  # 47 parts, a step between two (one forward: 1-2)
    assert len(a_tokens) == 400 and b == plain
    assert info.prefill_chunk_tokens == CHUNK and info.kv.pages_free == info.kv.pages_total


def test_a_running_stream_goes_on_while_a_long_prompt_is_admitted(stack, long_prompt):
    target, draft = stack

    async def run():
        async with make_channel(draft.addr) as dch, make_channel(target.addr) as tch:
            d = draft_pb2_grpc.DraftServiceStub(dch)
            a_times, b_times = [], []
            a = asyncio.ensure_future(_stream(d, "a", long_prompt[:30], 400, a_times))
            while not a_times:
                await asyncio.sleep(0.005)
            b_sent = time.monotonic()
            b = await _stream(d, "b", long_prompt, 16, b_times)
            a_tokens = await a
            plain = []
            async for msg in target_pb2_grpc.TargetServiceStub(tch).Generate(
                    target_pb2.TargetServiceGenerateRequest(
                        request_id="plain-b", prompt_ids=long_prompt,
                        sampling=common_pb2.SamplingParams(max_new_tokens=16, ignore_eos=True))):
                plain += list(msg.token_ids)
            return a_tokens, a_times, b_sent, b, b_times, plain

    a_tokens, a_times, b_sent, b, b_times, plain = asyncio.run(run())
    first_b = b_times[0][0]
    during = [n for t, n in a_times if b_sent < t < first_b]
    assert len(during) >= 3, (len(during), first_b - b_sent)  # "a" streamed while "b" was prefilled
    assert b == plain and len(a_tokens) == 400
