"""Another client's TargetService calls that name one running request end that request's stream at most: the
other streams of its batch go on with their tokens (QA: one Release or Verify naming one request ended all four
streams of a batch, each with an error about the other's id), the target's own Generate streams are not a
Verify's or a Release's to touch, and a Verify that cannot be answered is refused before it commits anything."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from services_stack import start_draft, start_target

from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

TOKENS = 160


@pytest.fixture(scope="module")
def stack():
    target = start_target("--num-pages", "600", "--max-batch-size", "8")
    draft = start_draft(target.addr, "--max-batch-size", "8")
    yield target, draft
    draft.stop()
    target.stop()


def _streams(stub_call, ids: list[str], prompt: list[int]) -> tuple[dict, threading.Event, list[threading.Thread]]:
    """Streams of TOKENS greedy tokens each, one thread each; `started` is set once every stream has tokens."""
    results: dict[str, tuple] = {}
    seen: set[str] = set()
    started = threading.Event()

    def run(rid: str) -> None:
        tokens: list[int] = []
        try:
            for msg in stub_call(rid, prompt):
                tokens += msg.token_ids
                seen.add(rid)
                if len(seen) == len(ids):
                    started.set()
            results[rid] = ("done", tokens)
        except grpc.RpcError as exc:
            results[rid] = (exc.code(), exc.details())
            started.set()

    threads = [threading.Thread(target=run, args=(rid,)) for rid in ids]
    for t in threads:
        t.start()
    return results, started, threads


def _sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_new_tokens=TOKENS, ignore_eos=True)


def _plain(target, prompt: list[int]) -> list[int]:
    with grpc.insecure_channel(target.addr) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        request = target_pb2.TargetServiceGenerateRequest(request_id=f"ref-{time.monotonic_ns()}", prompt_ids=prompt,
                                                          sampling=_sampling())
        return [t for m in stub.Generate(request, timeout=120) for t in m.token_ids]


@pytest.mark.parametrize("outside", ["release", "verify"])
def test_an_outside_call_naming_one_draft_stream_ends_that_stream_alone(stack, outside, dev_prompts, tiny_tokenizer):
    target, draft = stack
    prompt = tiny_tokenizer.encode(dev_prompts[11])[-40:]
    ids = [f"d{outside}-{i}" for i in range(4)]
    with grpc.insecure_channel(draft.addr) as dch, grpc.insecure_channel(target.addr) as tch:
        stub = draft_pb2_grpc.DraftServiceStub(dch)
        results, started, threads = _streams(lambda rid, p: stub.Generate(draft_pb2.DraftServiceGenerateRequest(
            request_id=rid, prompt_ids=p, sampling=_sampling()), timeout=120), ids, prompt)
        assert started.wait(60)
        t = target_pb2_grpc.TargetServiceStub(tch)
        if outside == "release":
            t.Release(target_pb2.ReleaseRequest(request_ids=[ids[0]]), timeout=10)
        else:  # a plain step of it, as its draft would send (it takes a token the draft never sees)
            with pytest.raises(grpc.RpcError):  # (or refused: its draft's call may be the one under way)
                for _ in range(50):
                    t.Verify(target_pb2.VerifyRequest(trees=[target_pb2.TreeProposal(request_id=ids[0])]),
                             timeout=10)
        for th in threads:
            th.join(120)
    reference = _plain(target, prompt)
    others = [results[rid] for rid in ids[1:]]
    assert others == [("done", reference)] * 3
    assert results[ids[0]][0] != "done" or results[ids[0]][1] != reference  # the one named lost its stream


@pytest.mark.parametrize("outside", ["release", "verify"])
def test_the_targets_own_generate_streams_are_no_verifys_or_releases(stack, outside, dev_prompts, tiny_tokenizer):
    target, _ = stack
    prompt = tiny_tokenizer.encode(dev_prompts[12])[-40:]
    ids = [f"t{outside}-{i}" for i in range(4)]
    with grpc.insecure_channel(target.addr) as tch:
        t = target_pb2_grpc.TargetServiceStub(tch)
        results, started, threads = _streams(lambda rid, p: t.Generate(target_pb2.TargetServiceGenerateRequest(
            request_id=rid, prompt_ids=p, sampling=_sampling()), timeout=120), ids, prompt)
        assert started.wait(60)
        if outside == "release":
            assert t.Release(target_pb2.ReleaseRequest(request_ids=[ids[0]]), timeout=10).num_released == 0
        else:
            with pytest.raises(grpc.RpcError) as err:
                t.Verify(target_pb2.VerifyRequest(trees=[target_pb2.TreeProposal(request_id=ids[0])]), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "is a Generate stream of this target" in err.value.details()
        for th in threads:
            th.join(120)
    reference = _plain(target, prompt)
    assert [results[rid] for rid in ids] == [("done", reference)] * 4


def test_a_verify_of_requests_with_different_feature_widths_is_refused_before_it_commits(stack):
    target, _ = stack
    prompt = list(range(50, 80))
    with grpc.insecure_channel(target.addr) as tch:
        t = target_pb2_grpc.TargetServiceStub(tch)
        for rid, layers in (("w1", []), ("w3", [0, 1, 2])):
            t.Prefill(target_pb2.PrefillRequest(request_id=rid, prompt_ids=prompt, sampling=_sampling(),
                                                feature_layer_ids=layers, return_features=True), timeout=30)
        trees = [target_pb2.TreeProposal(request_id=rid, num_generated=1) for rid in ("w1", "w3")]
        with pytest.raises(grpc.RpcError) as err:
            t.Verify(target_pb2.VerifyRequest(trees=trees), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "different layers" in err.value.details()
        for tree in trees:  # nothing was committed: each continues from its one prefill token
            reply = t.Verify(target_pb2.VerifyRequest(trees=[tree]), timeout=10)
            assert len(reply.results[0].tokens) == 1
        t.Release(target_pb2.ReleaseRequest(request_ids=["w1", "w3"]), timeout=10)
