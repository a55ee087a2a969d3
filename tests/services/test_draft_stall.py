"""A draft's engine thread that waits for its remote target's answer is not stalled: the target's own stall watch
and the draft's target watch judge that wait. Only the draft's own work counts toward its `--engine-stall-seconds`
(a burst of long prompts waits for the target's prefills for as long as they take)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from services_stack import start_draft, start_target

from draft_service.target_client import TargetClient
from specdec.engine.target_engine import TargetEngine
from specdec.errors import SpecdecError
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

PROMPT = [1, 331, 288, 1093, 297, 40, 77, 12]


def test_a_thread_in_a_call_to_the_target_is_seen_waiting_on_it():
    silent = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    client = TargetClient(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=1.5)
    caller = threading.Thread(target=_ask, args=(client,))
    try:
        caller.start()
        time.sleep(0.5)
        during = client.waits_on_target(caller.ident)
        caller.join(10)
        assert during and not client.waits_on_target(caller.ident)
        assert not client.waits_on_target(threading.get_ident()) and not client.waits_on_target(None)
        with client._waiting(time.monotonic() - 10):  # a thread still in a call well past its deadline: stuck in it
            assert not client.waits_on_target(threading.get_ident())
    finally:
        client.close()
        silent.close()


def _ask(client: TargetClient) -> None:
    with contextlib.suppress(SpecdecError):
        client.model_info(timeout_s=1.5)


def test_a_draft_waiting_on_a_slow_prefill_stays_serving(monkeypatch):
    """Also once the answer is in: the round's work after it counts from the answer, not from before the wait (QA:
    a 58 s wait ended, the draft counted its step as 58 s long and reported itself stalled for 3 s). Its extend
    over the prompt's features takes 0.6 s here, under the 1 s limit."""
    from specdec.engine.draft_engine import DraftEngine

    prefill, extend = TargetEngine.prefill, DraftEngine.extend
    extends = []

    def slow(engine, inputs):
        time.sleep(2.5)  # the target's forward of a long prompt, say
        return prefill(engine, inputs)

    def slow_extend(engine, items):
        if not extends:
            extends.append(1)
            time.sleep(0.6)
        return extend(engine, items)

    monkeypatch.setattr(TargetEngine, "prefill", slow)
    monkeypatch.setattr(DraftEngine, "extend", slow_extend)
    target = start_target()
    draft = start_draft(target.addr, "--engine-stall-seconds", "1")
    statuses: list[int] = []
    try:
        with grpc.insecure_channel(draft.addr) as ch:
            request = draft_pb2.DraftServiceGenerateRequest(
                request_id="slow", prompt_ids=PROMPT, sampling=common_pb2.SamplingParams(max_new_tokens=4))
            call = draft_pb2_grpc.DraftServiceStub(ch).Generate(request, timeout=30)
            health = health_pb2_grpc.HealthStub(ch)
            done = threading.Event()
            reader = threading.Thread(target=lambda: (list(call), done.set()))
            reader.start()
            while not done.wait(0.2):
                statuses.append(health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)
            reader.join()
    finally:
        draft.stop()
        target.stop()
    assert len(statuses) >= 8 and set(statuses) == {health_pb2.HealthCheckResponse.SERVING}, statuses
