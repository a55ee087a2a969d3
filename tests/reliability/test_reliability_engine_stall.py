"""A target's engine thread stops inside a step (a hung kernel, a deadlock) while its event loop still answers: past
`--engine-stall-seconds` the target reports UNKNOWN under every name (liveness included) and refuses new calls
saying why, the gateway moves the stream on to the other pair with the same text, and the target serves again once
the step ends. Before, health stayed SERVING: the gateway kept routing to the stuck target and its streams waited out
their deadlines (QA: 38.8-40.3 s for a 40 s stop)."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from reliability_support import (
    DRAFT_HEALTH,
    SERVING,
    TARGET_HEALTH,
    draft_kv,
    health,
    start_draft,
    start_gateway,
    start_target,
    target_kv,
    wait_pairs_up,
    wait_whole,
)

from specdec.engine.target_engine import TargetEngine
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc

UNKNOWN = health_pb2.HealthCheckResponse.UNKNOWN
PROMPT = 'def bfs(G, source):\n    """Breadth-first search from source."""\n'
SAMPLING = common_pb2.SamplingParams(max_new_tokens=96, ignore_eos=True)


class Freeze:
    """Holds the first engine that verifies once armed inside its `verify` until `release` (its thread stuck in one
    step; the process and its event loop go on)."""

    def __init__(self) -> None:
        self.armed, self.engine = False, None
        self.entered, self.hold = threading.Event(), threading.Event()

    def patch(self, monkeypatch) -> None:
        verify = TargetEngine.verify

        def held(engine, *args, **kwargs):
            if self.armed and self.engine in (None, engine):
                self.engine = engine
                self.entered.set()
                self.hold.wait(120)
            return verify(engine, *args, **kwargs)

        monkeypatch.setattr(TargetEngine, "verify", held)

    def release(self) -> None:
        self.armed = False
        self.hold.set()


@pytest.fixture
def stack(monkeypatch):
    freeze = Freeze()
    freeze.patch(monkeypatch)
    # pair A speculates (its target stalls); pair B is a target alone
    target_a = start_target("--engine-stall-seconds", "1")
    draft_a = start_draft(target_a.addr)  # (its own limit, 30 s: its thread waits on the stuck target meanwhile)
    target_b = start_target("--engine-stall-seconds", "1")
    gateway = start_gateway(f"{draft_a.addr}={target_a.addr}", f"={target_b.addr}")
    yield freeze, target_a, draft_a, target_b, gateway
    freeze.release()
    for service in (gateway, draft_a, target_b, target_a):
        service.stop()


def generate(addr: str, rid: str):
    channel = grpc.insecure_channel(addr)
    req = gateway_pb2.GatewayServiceGenerateRequest(prompt=PROMPT, sampling=SAMPLING, request_id=rid)
    return gateway_pb2_grpc.GatewayServiceStub(channel).Generate(req, timeout=60), channel


def text_and_final(messages) -> tuple[str, object]:
    return "".join(m.text for m in messages), messages[-1].final


def wait_for(what, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while not (value := what()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return value


def test_reliability_a_stalled_target_says_so_and_its_stream_moves_on(stack, caplog):
    freeze, target_a, draft_a, target_b, gateway = stack
    caplog.set_level(logging.WARNING)
    caplog.set_level(logging.INFO, logger="draft_service.target_client")
    call, channel = generate(gateway.addr, "before")
    reference, final = text_and_final(list(call))
    channel.close()
    assert final.speculative and final.fallbacks == 0  # served by pair A

    call, channel = generate(gateway.addr, "stalls")
    it = iter(call)
    first = [next(it)]
    freeze.armed = True
    t0 = time.monotonic()
    assert freeze.entered.wait(30), "pair A's target never verified again"
    messages = first + list(it)
    moved_in = time.monotonic() - t0
    channel.close()
    text, final = text_and_final(messages)
    assert text == reference  # greedy: the same text, continued on pair B's target
    assert final.fallbacks == 1 and not final.speculative  # straight to pair B, not onto the stalled target
    assert moved_in < 12, moved_in  # the stall (1 s), then the gateway's next check or the draft's watch

    # still stuck: every name says UNKNOWN, liveness included, and a call is refused saying why
    assert health(target_a.addr) == UNKNOWN and health(target_a.addr, TARGET_HEALTH) == UNKNOWN
    with grpc.insecure_channel(target_a.addr) as ch, pytest.raises(grpc.RpcError) as refused:
        target_pb2_grpc.TargetServiceStub(ch).GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "stalled" in refused.value.details() and "--engine-stall-seconds" in refused.value.details()
    wait_for(lambda: health(draft_a.addr, DRAFT_HEALTH) != SERVING)  # its target is away
    assert health(draft_a.addr, "liveness") == SERVING  # the draft itself moves: no restart for it
    assert any("stalled" in r.getMessage() and r.levelno == logging.ERROR for r in caplog.records)

    call, channel = generate(gateway.addr, "during")  # the gateway serves on: pair B
    during, final = text_and_final(list(call))
    channel.close()
    assert during == reference and not final.speculative

    freeze.release()  # the step ends: the target serves again, and the gateway speculates on pair A again
    wait_for(lambda: health(target_a.addr) == SERVING)
    wait_for(lambda: health(draft_a.addr, DRAFT_HEALTH) == SERVING)
    wait_pairs_up(gateway.addr, 2)
    assert any("moves again" in r.getMessage() for r in caplog.records)

    def speculates_again():  # (the gateway takes the draft back at its next check of it)
        call, channel = generate(gateway.addr, f"after-{time.monotonic()}")
        after, final = text_and_final(list(call))
        channel.close()
        assert after == reference and final.fallbacks == 0
        return final.speculative

    wait_for(speculates_again)
    # no page held by a request that ended: the stalled stream's draft releases it on pair A's target once that
    # answers again (before, its idle sweep did, 120 s later)
    for kv, service in ((target_kv, target_a), (draft_kv, draft_a), (target_kv, target_b)):
        free, total, running = wait_whole(kv, service.addr, timeout_s=10)
        assert free == total and running == 0, (service.addr, free, total, running)
    assert any("that ended while it was away" in r.getMessage() for r in caplog.records)
    print(f"a stalled target: its stream moved on after {moved_in:.1f} s")
