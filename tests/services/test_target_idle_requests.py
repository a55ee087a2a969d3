"""Requests whose draft is gone are released by the target (`--request-idle-seconds`): a draft killed together
with its gateway, or one that gave up on a Verify that timed out, never releases what it prefilled, and the
target kept the pages and the id (ALREADY_EXISTS for every retry) until restarted."""

from __future__ import annotations

import asyncio
import time

import grpc
from repo_paths import TINY

from specdec.engine.factory import EngineOptions, build_target
from specdec.engine.requests import PrefillInput, VerifyInput
from specdec.errors import UnknownRequest
from specdec.sampling_params import SamplingParams
from specdec.serving.service_thread import ServiceThread
from specdec.v1 import target_pb2, target_pb2_grpc
from target_service.app import serve


def test_requests_no_call_names_for_a_while_are_released():
    engine = build_target(str(TINY / "target"), EngineOptions(num_pages=64, max_batch_size=4))
    params = SamplingParams(max_new_tokens=20)
    engine.prefill([PrefillInput(rid, [5, 6, 7, 8], params, return_features=False) for rid in ("kept", "gone")])
    time.sleep(0.3)
    engine.verify([VerifyInput("kept", [], [])])  # named: alive
    assert engine.release_idle(0.2) == ["gone"]
    assert sorted(engine.requests) == ["kept"]
    try:
        engine.verify([VerifyInput("gone", [], [])])
        raise AssertionError("a released request was verified")
    except UnknownRequest:
        pass
    engine.release("kept")
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


def test_the_target_service_releases_an_abandoned_request_and_its_id_is_free_again():
    target = ServiceThread(serve, ["serve-target", "--model", str(TINY / "target"), "--port", "0",
                                   "--request-idle-seconds", "0.5"]).start()
    try:
        asyncio.run(_abandon_then_reuse(target.addr))
    finally:
        target.stop()


async def _abandon_then_reuse(addr: str) -> None:
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)

        async def running() -> int:
            return (await stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest())).num_running

        prefill = target_pb2.PrefillRequest(request_id="orphan", prompt_ids=[5, 6, 7, 8])
        await stub.Prefill(prefill)  # a draft that then died: nothing names it again
        assert await running() == 1
        with_limit = time.monotonic() + 10
        while await running():
            assert time.monotonic() < with_limit, "the abandoned request was never released"
            await asyncio.sleep(0.1)
        info = await stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest())
        assert info.kv.pages_free == info.kv.pages_total
        await stub.Prefill(prefill)  # the id is free again (it was ALREADY_EXISTS for good)
        await stub.Release(target_pb2.ReleaseRequest(request_ids=["orphan"]))


def test_a_target_that_stood_still_releases_nothing_as_it_wakes(monkeypatch):
    """The sweep after a stall of the target itself (stopped, a paused VM, a long step) releases nothing and
    starts every request's idle time over: the drafts may have been waiting on the target all along. A later
    sweep on time releases what is really idle."""
    from target_service import app

    monkeypatch.setattr(app, "STALL_SLACK_S", 0.2)
    engine = build_target(str(TINY / "target"), EngineOptions(num_pages=64, max_batch_size=4))
    engine.prefill([PrefillInput("r", [5, 6, 7, 8], SamplingParams(max_new_tokens=20), return_features=False)])
    sweep = app.IdleRelease(engine, idle_s=0.3, every_s=0.05)
    time.sleep(0.5)  # no sweep ran: the target stood still past the limit
    sweep()
    assert list(engine.requests) == ["r"]
    time.sleep(0.1)
    sweep()  # on time, the request named 0.1 s ago (as of the stall's end)
    assert list(engine.requests) == ["r"]
    for _ in range(8):  # sweeps on time until the request has been idle past the limit
        time.sleep(0.05)
        sweep()
    assert not engine.requests and engine.kv.num_free_pages == engine.kv.num_total_pages
