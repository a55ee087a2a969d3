"""Target and draft services over real gRPC on loopback with the shipped tiny pair."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from repo_paths import TINY
from services_stack import start_draft, start_target

from specdec.rpc.channel import make_channel
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


@pytest.fixture(scope="module")
def stack():
    target = start_target("--num-pages", "600", "--max-batch-size", "32")
    draft = start_draft(target.addr, "--num-steps", "4", "--topk", "2", "--num-draft-tokens", "6",
                        "--max-batch-size", "32")
    yield target, draft
    draft.stop()
    target.stop()


@pytest.fixture(scope="module")
def prompts(dev_prompts, tiny_tokenizer):
    return [tiny_tokenizer.encode(p)[-(40 + 7 * i):] for i, p in enumerate(dev_prompts[20:36])]


async def _collect(stream) -> tuple[list[int], object]:
    tokens, last = [], None
    async for msg in stream:
        tokens += list(msg.token_ids)
        last = msg
    return tokens, last


def _sampling(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)


async def _both(stack, prompt, rid, **sampling):
    target, draft = stack
    async with make_channel(draft.addr) as dch, make_channel(target.addr) as tch:
        d = draft_pb2_grpc.DraftServiceStub(dch)
        t = target_pb2_grpc.TargetServiceStub(tch)
        spec = _collect(d.Generate(draft_pb2.DraftServiceGenerateRequest(
            request_id=f"d-{rid}", prompt_ids=prompt, sampling=_sampling(**sampling))))
        plain = _collect(t.Generate(target_pb2.TargetServiceGenerateRequest(
            request_id=f"t-{rid}", prompt_ids=prompt, sampling=_sampling(**sampling))))
        return await asyncio.gather(spec, plain)


async def _kv_free(stack) -> tuple[bool, bool]:
    target, draft = stack
    async with make_channel(draft.addr) as dch, make_channel(target.addr) as tch:
        ti = await target_pb2_grpc.TargetServiceStub(tch).GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest())
        di = await draft_pb2_grpc.DraftServiceStub(dch).GetModelInfo(draft_pb2.DraftServiceGetModelInfoRequest())
        return ti.kv.pages_free == ti.kv.pages_total, di.kv.pages_free == di.kv.pages_total


def test_16_concurrent_greedy_streams_equal_target_generate(stack, prompts):
    async def run():
        jobs = [_both(stack, p, f"c{i}", max_new_tokens=8 + 3 * i) for i, p in enumerate(prompts)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    taus = []
    for (spec_tokens, spec_last), (plain_tokens, plain_last) in results:
        assert spec_tokens == plain_tokens
        assert spec_last.final.finish_reason == plain_last.finish_reason != 0
        assert spec_last.final.completion_tokens == len(spec_tokens)
        taus.append(spec_last.final.tau)
    assert sum(taus) / len(taus) > 2.0
    assert asyncio.run(_kv_free(stack)) == (True, True)


def test_seeded_sampling_is_reproducible(stack, prompts):
    async def run(rid):
        (tokens, last), _ = await _both(stack, prompts[0], rid, temperature=0.9, top_p=0.9, seed=7,
                                        max_new_tokens=20)
        return tokens

    assert asyncio.run(run("s1")) == asyncio.run(run("s2"))


def test_cancel_and_abort_free_kv_in_both_services(stack, prompts, caplog):
    target, draft = stack
    caplog.set_level("INFO", logger="draft_service.servicer")

    async def run():
        async with make_channel(draft.addr) as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)
            call = stub.Generate(draft_pb2.DraftServiceGenerateRequest(
                request_id="cancel-me", prompt_ids=prompts[1], sampling=_sampling(max_new_tokens=500, ignore_eos=True)))
            async for _ in call:
                break
            call.cancel()
            call2 = stub.Generate(draft_pb2.DraftServiceGenerateRequest(
                request_id="abort-me", prompt_ids=prompts[2], sampling=_sampling(max_new_tokens=500, ignore_eos=True)))
            async for _ in call2:
                break
            found = await stub.Abort(draft_pb2.AbortRequest(request_id="abort-me"))
            tail = [m async for m in call2]
            assert found.found
            assert tail and tail[-1].final.finish_reason == common_pb2.FINISH_REASON_ABORT
        for _ in range(50):
            if await _kv_free(stack) == (True, True):
                return True
            await asyncio.sleep(0.1)
        return False

    assert asyncio.run(run())
    # the cancelled request has its log line too (QA: only finished requests had one)
    assert any(r.getMessage().startswith("ended early:") for r in caplog.records), caplog.text[-2000:]


@pytest.mark.parametrize("req,code,msg", [
    (dict(prompt_ids=[]), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    (dict(prompt_ids=[5, 99999]), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    (dict(prompt_ids=[5, 6], sampling=_sampling(temperature=-1)), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (dict(prompt_ids=[5, 6], sampling=_sampling(top_p=0)), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    (dict(prompt_ids=[5] * 5000), grpc.StatusCode.INVALID_ARGUMENT, "context length"),
    (dict(prompt_ids=[5, 6], request_id=""), grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    (dict(prompt_ids=[5, 6], request_id="__warmup-mine"), grpc.StatusCode.INVALID_ARGUMENT, "reserved"),
])
def test_bad_input_gets_status_and_services_keep_serving(stack, req, code, msg):
    target, draft = stack

    async def run():
        async with make_channel(draft.addr) as dch, make_channel(target.addr) as tch:
            for stub, cls in ((draft_pb2_grpc.DraftServiceStub(dch), draft_pb2.DraftServiceGenerateRequest),
                              (target_pb2_grpc.TargetServiceStub(tch), target_pb2.TargetServiceGenerateRequest)):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _collect(stub.Generate(cls(**{"request_id": "bad", **req})))
                assert err.value.code() == code and msg in err.value.details()

    asyncio.run(run())
    (spec, _), (plain, _) = asyncio.run(_both(stack, [331, 288, 798], "after-bad", max_new_tokens=6))
    assert spec == plain and len(spec) == 6


def test_target_rpc_errors(stack):
    target, _ = stack

    async def run():
        async with make_channel(target.addr) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Verify(target_pb2.VerifyRequest(trees=[target_pb2.TreeProposal(request_id="ghost")]))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            await stub.Prefill(target_pb2.PrefillRequest(request_id="p1", prompt_ids=[5, 6, 7], return_features=True))
            with pytest.raises(grpc.aio.AioRpcError) as err:  # parent after child
                await stub.Verify(target_pb2.VerifyRequest(trees=[target_pb2.TreeProposal(
                    request_id="p1", draft_tokens=[1, 2], parents=[1, -1])]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(target_pb2.PrefillRequest(request_id="p1", prompt_ids=[5]))
            assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
            ok = await stub.Verify(target_pb2.VerifyRequest(trees=[target_pb2.TreeProposal(
                request_id="p1", draft_tokens=[1, 2], parents=[-1, 0])]))  # still usable after the bad call
            assert ok.results[0].tokens
            big = []
            with pytest.raises(grpc.aio.AioRpcError) as err:  # each reserves ~133 of the 600 pages
                for i in range(6):
                    await stub.Prefill(target_pb2.PrefillRequest(
                        request_id=f"huge-{i}", prompt_ids=[5] * 2000, sampling=_sampling(max_new_tokens=1000)))
                    big.append(f"huge-{i}")
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV pool full" in err.value.details()
            assert len(big) == 4
            rel = await stub.Release(target_pb2.ReleaseRequest(request_ids=["p1", "never-seen", *big]))
            assert rel.num_released == 5

    asyncio.run(run())
    assert asyncio.run(_kv_free(stack))[0]


def test_verify_plain_steps_over_grpc(stack):
    """`VerifyRequest.plain_steps`: several plain decode steps in one call give the tokens and feature rows of as
    many one-step calls; `feature_rows` (Verify and Prefill) keeps the last rows only; a bad count or a tree with
    drafts is INVALID_ARGUMENT and changes nothing."""
    target, _ = stack

    async def run():
        async with make_channel(target.addr) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            prefills = [await stub.Prefill(target_pb2.PrefillRequest(
                request_id=rid, prompt_ids=list(range(40, 90)), return_features=True, feature_rows=rows))
                for rid, rows in (("many", 0), ("one", 0), ("last", 2))]
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(target_pb2.PrefillRequest(request_id="bad", prompt_ids=[5, 6], feature_rows=-2))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "feature_rows" in err.value.details()
            tree = [target_pb2.TreeProposal(request_id="many")]
            for bad, field in ((target_pb2.VerifyRequest(trees=tree, plain_steps=65), "plain_steps"),
                               (target_pb2.VerifyRequest(trees=[target_pb2.TreeProposal(
                                   request_id="many", draft_tokens=[5], parents=[-1])], plain_steps=2), "plain_steps"),
                               (target_pb2.VerifyRequest(trees=tree, plain_steps=2, feature_rows=-1), "feature_rows")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Verify(bad)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
            many = await stub.Verify(target_pb2.VerifyRequest(trees=tree, plain_steps=3))
            one = [await stub.Verify(target_pb2.VerifyRequest(trees=[target_pb2.TreeProposal(request_id="one")]))
                   for _ in range(3)]
            last = await stub.Verify(target_pb2.VerifyRequest(trees=[target_pb2.TreeProposal(request_id="last")],
                                                              plain_steps=3, feature_rows=1))
            await stub.Release(target_pb2.ReleaseRequest(request_ids=["many", "one", "last"]))
        return many, one, last, prefills

    many, one, last, prefills = asyncio.run(run())
    assert list(prefills[0].features.shape)[0] == 50 and list(prefills[2].features.shape)[0] == 2
    assert prefills[2].features.data == prefills[0].features.data[48 * len(prefills[0].features.data) // 50 :]
    result = many.results[0]
    assert list(result.tokens) == [t for r in one for t in r.results[0].tokens] and len(result.tokens) == 3
    assert result.num_accepted_drafts == 0 and result.num_feature_rows == 3 and list(many.features.shape)[0] == 3
    assert list(last.results[0].tokens) == list(result.tokens) and last.results[0].num_feature_rows == 1
    assert list(last.features.shape) == [1, list(many.features.shape)[1]]
    width = len(many.features.data) // 3
    assert last.features.data == many.features.data[2 * width :]  # the last token's row, bit for bit
    assert asyncio.run(_kv_free(stack))[0]


async def _stream(draft_addr: str, prompt, rid: str, max_new_tokens: int = 48):
    async with make_channel(draft_addr) as ch:
        return await _collect(draft_pb2_grpc.DraftServiceStub(ch).Generate(draft_pb2.DraftServiceGenerateRequest(
            request_id=rid, prompt_ids=prompt, sampling=_sampling(max_new_tokens=max_new_tokens))))


async def _pairs(draft_addr: str, target_addr: str, prompts, lengths: list[int], tag: str):
    """Every prompt to this draft service and to target Generate at once: (draft token lists, target token lists,
    whether the draft's KV pool is all free afterwards)."""
    async with make_channel(draft_addr) as dch, make_channel(target_addr) as tch:
        d, t = draft_pb2_grpc.DraftServiceStub(dch), target_pb2_grpc.TargetServiceStub(tch)
        jobs = []
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
            s = _sampling(max_new_tokens=n)
            jobs.append(_collect(d.Generate(draft_pb2.DraftServiceGenerateRequest(
                request_id=f"{tag}-{i}", prompt_ids=p, sampling=s))))
            jobs.append(_collect(t.Generate(target_pb2.TargetServiceGenerateRequest(
                request_id=f"{tag}-plain-{i}", prompt_ids=p, sampling=s))))
        out = await asyncio.gather(*jobs)
        di = await d.GetModelInfo(draft_pb2.DraftServiceGetModelInfoRequest())
    return [o[0] for o in out[::2]], [o[0] for o in out[1::2]], di.kv.pages_free == di.kv.pages_total


def test_adaptive_speculation_service_is_lossless(stack, prompts):
    """`--speculation auto` switches between speculative and plain steps by measured tokens/s; the stream
    still equals target Generate token for token. Its start-up calibration at batch sizes 1, 2 and 4
    (`--calibration-max-batch 4`) leaves both KV pools free."""
    target, _ = stack
    auto = start_draft(target.addr, "--speculation", "auto", "--max-batch-size", "8", "--calibration-max-batch", "4")
    try:
        assert asyncio.run(_kv_free(stack))[0]
        spec, plain, draft_free = asyncio.run(_pairs(auto.addr, target.addr, prompts[:6], [40] * 6, "auto"))
        assert spec == plain and draft_free
    finally:
        auto.stop()


def test_a_draft_stopped_while_it_calibrates_leaves_nothing_on_its_target(stack):
    """SIGTERM to a draft process while it calibrates (its throw-away requests on the target): the calibration ends
    between steps and releases them, so the target's pages are free at once. QA: `close` did not reach the engine
    loop during start-up, the process exited, and its 64 throw-away requests held 800 of the target's pages until
    the target's idle release, 120 s later."""
    import signal
    import subprocess
    import sys

    from repo_paths import REPO

    target, _ = stack
    argv = [sys.executable, "-m", "specdec", "serve-draft", "--model", str(TINY / "draft"), "--target-model",
            str(TINY / "target"), "--target", target.addr, "--port", "0", "--drain-seconds", "1",
            "--max-batch-size", "16", "--calibration-max-batch", "16"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        # (2 or more: calibration's batch sizes above 1, not the verify warm-up's one request before it)
        while _target_info(target).num_running < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert _target_info(target).num_running >= 2, "the calibration's requests never reached the target"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "calibration stopped: the service is stopping" in err, err[-2000:]
    while (info := _target_info(target)).num_running and time.monotonic() - t0 < 5:  # (a Prefill cancelled in
        time.sleep(0.05)  # flight is released by the target once it lands)
    assert info.num_running == 0 and info.kv.pages_unreserved == info.kv.pages_free == info.kv.pages_total
    assert time.monotonic() - t0 < 5  # (the target's idle release would have taken 120 s)


def _target_info(target):
    from draft_service.target_client import TargetClient

    client = TargetClient(target.addr)
    try:
        return client.model_info()
    finally:
        client.close()


def test_speculation_off_decodes_plainly_through_verify_without_features(stack, prompts):
    """`--speculation off`: the draft service keeps serving (same API, same streams) but never speculates: it
    decodes plainly through the target's Verify, several tokens per call, and asks for no features (its client
    refuses a Verify reply whose feature rows it did not ask for, so equal streams also say none came), two calls
    in flight (`--plain-calls-in-flight`, default 2: the next goes out before the previous one's reply, over the
    real channel). Streams equal target Generate, tau is 1, both KV pools end free; 0 calls in flight is refused
    at start-up naming the flag."""
    target, _ = stack
    off = start_draft(target.addr, "--speculation", "off", "--max-batch-size", "8", "--plain-steps", "4")
    try:
        spec, plain, draft_free = asyncio.run(_pairs(off.addr, target.addr, prompts[:6], [20] * 6, "off"))
        assert spec == plain and draft_free and asyncio.run(_kv_free(stack))[0]
        _, last = asyncio.run(_stream(off.addr, prompts[6], "off-tau", max_new_tokens=16))
        assert last.final.tau == 1.0 and last.final.completion_tokens == 16
    finally:
        off.stop()
    with pytest.raises(RuntimeError, match="plain-calls-in-flight"):
        start_draft(target.addr, "--plain-calls-in-flight", "0")


def test_fp8_features_service_is_lossless_and_refuses_unknown_feature_dtypes(stack, prompts):
    """`--feature-wire fp8`: the target sends this draft's features as 8-bit floats with a scale per row; the
    streams still equal target Generate and both KV pools end free. A Prefill asking for another feature dtype
    is INVALID_ARGUMENT."""
    target, _ = stack
    fp8 = start_draft(target.addr, "--feature-wire", "fp8", "--speculation", "always", "--max-batch-size", "8")
    try:
        spec, plain, draft_free = asyncio.run(_pairs(fp8.addr, target.addr, prompts[:6], [30] * 6, "fp8"))
        assert spec == plain and draft_free and asyncio.run(_kv_free(stack))[0]
        # the 8-bit features still drive the head (garbage would give ~1): tau over several prompts (one prompt's
        # ranged 1.74-3+ with the prompt source: the project's own function openings in a clone without ../shared)
        finals = [asyncio.run(_stream(fp8.addr, p, f"fp8-tau{i}"))[1].final for i, p in enumerate(prompts[6:12])]
        tau = sum(f.completion_tokens - 1 for f in finals) / sum((f.completion_tokens - 1) / f.tau for f in finals)
        assert tau > 2.0
    finally:
        fp8.stop()

    async def bad():
        async with make_channel(target.addr) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await target_pb2_grpc.TargetServiceStub(ch).Prefill(target_pb2.PrefillRequest(
                    request_id="fp4", prompt_ids=[5, 6], return_features=True, feature_dtype="float4"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "feature_dtype" in err.value.details()

    asyncio.run(bad())


def test_two_batch_overlap_service_is_lossless_and_frees_kv(stack, prompts):
    """`--two-batch-overlap 2`: micro-batches take turns at the target over gRPC (two Verify calls can be out at
    once); every stream still equals target Generate and both services end with all KV pages free."""
    target, _ = stack
    overlapped = start_draft(target.addr, "--two-batch-overlap", "2", "--max-batch-size", "8", "--num-pages", "600")
    try:
        lengths = [12 + 4 * i for i in range(10)]
        spec, plain, draft_free = asyncio.run(_pairs(overlapped.addr, target.addr, prompts[:10], lengths, "tbo"))
        assert spec == plain
        assert draft_free and asyncio.run(_kv_free(stack))[0]
    finally:
        overlapped.stop()


def test_the_drafts_warm_up_runs_every_shape_through_the_real_client(stack, caplog):
    """The start-up warm-up against a target service through the draft's own client (which checks every reply):
    every shape verified, no warning, nothing left admitted on the target."""
    from draft_service.target_client import TargetClient
    from specdec.engine.warmup import warm_verify_shapes, warmup_trees

    target, _ = stack
    client = TargetClient(target.addr)
    sent = []
    verify = client.verify
    client.verify = lambda inputs, **kw: (sent.append(inputs[0].parents), verify(inputs, **kw))[1]
    try:
        info = client.model_info()
        before = info.kv.pages_free
        with caplog.at_level("INFO", logger="specdec.engine.warmup"):
            warm_verify_shapes(client, [3, 6], 2, (), info.vocab_size)
        assert sent == warmup_trees([3, 6], 2)
        assert "warm-up:" in caplog.text and "stopped" not in caplog.text and "skipped" not in caplog.text
        assert client.model_info().kv.pages_free == before
    finally:
        client.close()


def test_model_info_reports_the_pages_admission_can_still_give(stack):
    """GetModelInfo's `kv.pages_unreserved`: a held request reserves its worst case (prompt, max_new_tokens, tree
    slots) at admission but writes pages as it goes, so `pages_free` stays near the total while this drops by the
    reservation (QA: a target refusing requests RESOURCE_EXHAUSTED reported 15 of 30 pages free)."""
    from draft_service.target_client import TargetClient
    from specdec.engine.requests import PrefillInput
    from specdec.sampling_params import SamplingParams

    target, _ = stack
    client = TargetClient(target.addr)
    try:
        before = client.model_info().kv
        assert before.pages_unreserved == before.pages_free
        client.prefill([PrefillInput("unreserved-1", [5, 6, 7], SamplingParams(max_new_tokens=1000), (), False)])
        held = client.model_info().kv
        pages = -(-(3 + 1000) // held.page_size)
        assert held.pages_free >= before.pages_free - 1  # one page written
        assert held.pages_unreserved <= before.pages_unreserved - pages
        client.release("unreserved-1")
        assert client.model_info().kv == before
    finally:
        client.close()


def test_the_drafts_client_takes_trimmed_feature_rows_from_prefill_and_verify(stack):
    """`feature_rows` through the draft's own client, which checks each reply's rows against what it asked for:
    the last prompt token's features from a Prefill, the last token's from a plain Verify of 4 steps, equal to
    the last rows of an untrimmed request's."""
    import torch

    from draft_service.target_client import TargetClient
    from specdec.engine.requests import PrefillInput, VerifyInput
    from specdec.sampling_params import SamplingParams

    target, _ = stack
    client = TargetClient(target.addr)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    try:
        full, last = client.prefill([PrefillInput("c-all", list(range(60, 90)), params),
                                     PrefillInput("c-last", list(range(60, 90)), params, feature_rows=1)])
        assert full.features.shape[0] == 30 and last.features.shape[0] == 1
        assert torch.equal(last.features, full.features[-1:])
        all_rows = client.verify([VerifyInput("c-all", [], [])], plain_steps=4)[0]
        one_row = client.verify([VerifyInput("c-last", [], [])], plain_steps=4, feature_rows=1)[0]
        assert one_row.tokens == all_rows.tokens and len(all_rows.tokens) == 4
        assert one_row.features.shape[0] == 1 and torch.equal(one_row.features, all_rows.features[-1:])
    finally:
        for rid in ("c-all", "c-last"):
            client.release(rid)
        client.close()
    assert asyncio.run(_kv_free(stack))[0]


def test_the_drafts_client_reads_each_target_error_as_its_engine_exception(stack):
    """Every status the target's errors name comes back through the draft's client as that error's class: an
    overtaking pipelined plain call (ABORTED) as `OutOfOrder`, which the pipeline sends again. Before, ABORTED
    came back as a bare SpecdecError (INTERNAL): its whole batch failed and the gateway took the draft out (QA)."""
    import specdec.errors as errors
    from draft_service.target_client import TargetClient, _translate
    from specdec.engine.requests import PrefillInput, VerifyInput
    from specdec.sampling_params import SamplingParams

    class Status(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "x"

    # (CANCELLED from the target is the target going away, not a `Cancelled` of the draft's: test_target_cancels.py)
    kinds = [c for c in vars(errors).values()
             if isinstance(c, type) and issubclass(c, errors.SpecdecError)
             and c.status not in ("INTERNAL", "FAILED_PRECONDITION", "CANCELLED")]
    assert errors.OutOfOrder in kinds
    for cls in kinds:
        assert type(_translate(Status(grpc.StatusCode[cls.status]))) is cls, cls
    target, _ = stack
    client = TargetClient(target.addr)
    try:
        client.prefill([PrefillInput("ooo", list(range(60, 90)), SamplingParams(max_new_tokens=20, ignore_eos=True),
                                     return_features=False)])
        client.features = False
        ahead = client.verify_start([VerifyInput("ooo", [], [], num_generated=9)], plain_steps=4)
        with pytest.raises(errors.OutOfOrder, match="the call continues from 9"):
            client.verify_finish(ahead)
        assert len(client.verify([VerifyInput("ooo", [], [], num_generated=1)], plain_steps=4)[0].tokens) == 4
    finally:
        client.release("ooo")
        client.close()
    assert asyncio.run(_kv_free(stack))[0]


def test_a_prefill_cancelled_while_the_draft_waits_for_it_is_dropped_and_nothing_is_left_on_the_target(stack):
    """`TargetClient.cancel_prefill` (the draft's engine loop calls it when a client leaves during its request's
    admission): the cancelled requests' answers are `Cancelled`; whether the target had run their forward or not,
    nothing of theirs stays admitted there; the request beside them is admitted as usual."""
    import threading

    from draft_service.target_client import TargetClient
    from specdec.engine.requests import PrefillInput, PrefillOutput
    from specdec.errors import Cancelled
    from specdec.sampling_params import SamplingParams

    target, _ = stack
    client = TargetClient(target.addr)
    client.features = False
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    inputs = [PrefillInput(f"pc{i}", [(7 * j + i) % 500 + 3 for j in range(1500)], params, return_features=False)
              for i in range(4)]
    answers = []
    try:
        worker = threading.Thread(target=lambda: answers.extend(client.prefill_each(inputs)))
        worker.start()
        for _ in range(200):  # cancel as soon as the calls are in flight
            if len(client._admitting) == 4:
                break
            threading.Event().wait(0.001)
        for rid in ("pc1", "pc2", "pc3"):
            client.cancel_prefill(rid)
        worker.join(60)
        assert isinstance(answers[0], PrefillOutput)
        assert all(isinstance(a, Cancelled) for a in answers[1:]), answers
        assert not client._admitting
    finally:
        client.release("pc0")
        client.close()
    assert asyncio.run(_kv_free(stack))[0]


def _lossless_with_and_refused(target, prompts, new_tokens: int, option: str, value: str, bad: str,
                               max_batch: int) -> None:
    """A draft started with `option value` streams what target Generate streams for every prompt (`new_tokens`
    each, all at once) and frees its pages; started with `option bad` it stops start-up naming the option."""
    draft = start_draft(target.addr, option, value, "--max-batch-size", str(max_batch))
    try:
        tag = option.lstrip("-")
        spec, plain, draft_free = asyncio.run(_pairs(draft.addr, target.addr, prompts, [new_tokens] * len(prompts),
                                                     tag))
        assert spec == plain and draft_free
    finally:
        draft.stop()
    with pytest.raises(RuntimeError, match=tag):
        start_draft(target.addr, option, bad)


def test_a_small_prompt_feature_budget_stays_lossless_and_a_negative_one_is_refused(stack, prompts):
    """`--prompt-feature-mb`: with a budget this small every prompt of a wave brings its last 64 tokens' features
    only (the draft skips the rest); 8 streams still equal target Generate, and nothing leaks."""
    _lossless_with_and_refused(stack[0], prompts[:8], 20, "--prompt-feature-mb", "0.001", "-1", 8)


def test_burst_gathering_service_is_lossless_and_a_negative_window_is_refused(stack, prompts):
    """`--admission-gather-ms`: an idle draft waits for the rest of a burst before admitting it; 10 streams opened
    at once still equal target Generate with a long window, and a negative window stops start-up with a message
    naming the flag."""
    _lossless_with_and_refused(stack[0], prompts[:10], 16, "--admission-gather-ms", "200", "-1", 16)


def test_a_requests_own_smaller_tree_stays_lossless_beside_full_trees(stack, prompts):
    """`spec` on a Generate (SpecParams) asks for a smaller tree than the service's (num_steps 4, topk 2, 6 drafts
    here): that request's trees are the service's pruned to it, verified in the same batch as the full trees of
    the others. Every stream equals target Generate; a capped request never commits more tokens a step than its
    tree is deep (+1, the bonus token); the service's own shape is accepted too; both KV pools end free."""
    caps = [None, common_pb2.SpecParams(num_draft_tokens=2), common_pb2.SpecParams(num_steps=1),
            common_pb2.SpecParams(topk=1, num_draft_tokens=3), common_pb2.SpecParams(num_steps=4, topk=2,
                                                                                     num_draft_tokens=6), None]
    target, draft = stack

    async def run():
        async with make_channel(draft.addr) as dch, make_channel(target.addr) as tch:
            d, t = draft_pb2_grpc.DraftServiceStub(dch), target_pb2_grpc.TargetServiceStub(tch)
            jobs = []
            for i, (p, cap) in enumerate(zip(prompts, caps)):  # noqa: B905 - the first len(caps) prompts
                req = draft_pb2.DraftServiceGenerateRequest(request_id=f"cap-{i}", prompt_ids=p,
                                                            sampling=_sampling(max_new_tokens=40))
                if cap is not None:
                    req.spec.CopyFrom(cap)
                jobs.append(_collect(d.Generate(req)))
                jobs.append(_collect(t.Generate(target_pb2.TargetServiceGenerateRequest(
                    request_id=f"cap-plain-{i}", prompt_ids=p, sampling=_sampling(max_new_tokens=40)))))
            return await asyncio.gather(*jobs)

    out = asyncio.run(run())
    for cap, (spec_tokens, last), (plain_tokens, _) in zip(caps, out[::2], out[1::2], strict=True):
        assert spec_tokens == plain_tokens
        depth = 4 if cap is None else min(cap.num_steps or 4, cap.num_draft_tokens or 6)
        assert len(last.final.accepted_per_position) <= depth
        assert last.final.tau <= depth + 1
    assert asyncio.run(_kv_free(stack)) == (True, True)


def test_the_draft_reports_its_context_and_refuses_prompts_past_it(stack, prompts):
    """GetModelInfo's `max_context_len`: the target's, or the draft's own smaller --max-context; a prompt of that
    many tokens is INVALID_ARGUMENT naming the draft's context (the gateway serves it plainly on the target)."""
    target, draft = stack
    small = start_draft(target.addr, "--max-context", "32", "--max-batch-size", "4")

    async def body():
        infos, refused = [], None
        for addr in (draft.addr, small.addr):
            async with make_channel(addr) as channel:
                stub = draft_pb2_grpc.DraftServiceStub(channel)
                infos.append((await stub.GetModelInfo(draft_pb2.DraftServiceGetModelInfoRequest())).max_context_len)
                if addr == small.addr:
                    try:
                        await _collect(stub.Generate(draft_pb2.DraftServiceGenerateRequest(
                            request_id="ctx-long", prompt_ids=prompts[0][:32] * 2,
                            sampling=_sampling(max_new_tokens=2))))
                    except grpc.aio.AioRpcError as exc:
                        refused = exc
                    served, _ = await _collect(stub.Generate(draft_pb2.DraftServiceGenerateRequest(
                        request_id="ctx-short", prompt_ids=prompts[0][:20], sampling=_sampling(max_new_tokens=4))))
        return infos, refused, served

    try:
        infos, refused, served = asyncio.run(body())
    finally:
        small.stop()
    assert infos == [_target_info(target).max_context_len, 32]
    assert refused is not None and refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "draft's context length is 32" in refused.details()
    assert len(served) == 4


def test_a_stopping_draft_releases_what_it_still_holds_on_its_target(stack):
    """`_release_held` (the draft's close, once its engine thread stopped): the scheduler's running requests and the
    pending releases go to the target in one call, so its pages are free before its own drain would wait them out
    (QA: `specdec up` stopped the target 30 s after the draft)."""
    from types import SimpleNamespace

    from draft_service.app import _release_held
    from draft_service.target_client import TargetClient
    from specdec.engine.requests import PrefillInput
    from specdec.sampling_params import SamplingParams

    target, _ = stack
    client = TargetClient(target.addr)
    try:
        before = client.model_info()
        client.prefill([PrefillInput(rid, [5, 6, 7], SamplingParams(max_new_tokens=50), (), False)
                        for rid in ("held-1", "held-2", "held-3")])
        client.release_later(["held-3"])  # one the target was away for when it ended
        assert client.model_info().num_running == before.num_running + 3
        _release_held(SimpleNamespace(running={"held-1": None, "held-2": None}), client)
        after = client.model_info()
        assert after.num_running == before.num_running and after.kv == before.kv
    finally:
        client.close()
