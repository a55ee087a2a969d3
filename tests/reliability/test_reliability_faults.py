"""Faults: the target dies under running requests, the target sends malformed features, deadlines pass.

Pair A is an in-process draft over a target *process* (port fixed, so it can be killed and restarted); pair B is
an in-process target alone. The gateway routes over both. (The draft dying mid-stream is covered by
tests/gateway/test_gateway_e2e.py::test_gateway_e2e_draft_killed_mid_stream_same_text.)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from concurrent import futures

import grpc
import pytest
from reliability_support import (
    DRAFT_HEALTH,
    NOT_SERVING,
    PROMPT_IDS,
    SERVING,
    TINY,
    draft_kv,
    health,
    start_draft,
    start_gateway,
    start_target,
    target_kv,
    target_process,
    wait_pairs_up,
    wait_whole,
)

from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, target_pb2_grpc

PROMPT = 'def bfs(G, source):\n    """Breadth-first search from source."""\n'
LONG = common_pb2.SamplingParams(max_new_tokens=300, ignore_eos=True)


def gateway_generate(addr: str, no_speculation: bool = False, timeout: float = 120, sampling=LONG):
    channel = grpc.insecure_channel(addr)
    stub = gateway_pb2_grpc.GatewayServiceStub(channel)
    req = gateway_pb2.GatewayServiceGenerateRequest(prompt=PROMPT, sampling=sampling, no_speculation=no_speculation)
    return stub.Generate(req, timeout=timeout), channel


def pairs_up(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        return gateway_pb2_grpc.GatewayServiceStub(ch).ListModels(gateway_pb2.ListModelsRequest(), timeout=5) \
            .models[0].pairs_up


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    target_a = target_process(log_dir=logs).start().wait_serving("specdec.v1.TargetService")
    draft_a = start_draft(target_a.addr)
    target_b = start_target()
    gateway = start_gateway(f"{draft_a.addr}={target_a.addr}", f"={target_b.addr}")
    wait_pairs_up(gateway.addr, 2)
    stack = {"target_a": target_a, "draft_a": draft_a, "target_b": target_b, "gateway": gateway, "logs": logs}
    yield stack
    gateway.stop()
    draft_a.stop()
    target_b.stop()
    stack["target_a"].kill()  # the restarted process, if a test restarted it (the first one is dead then)


def restart_target_a(stack) -> float:
    """Start pair A's target again and wait until the gateway speculates on pair A (its draft reports SERVING
    again once its target answers: `TargetWatch`); -> seconds from the target's SERVING to that."""
    old = stack["target_a"]
    stack["target_a"] = target_process(port=old.port, log_dir=stack["logs"]).start() \
        .wait_serving("specdec.v1.TargetService")
    t0 = time.monotonic()
    while True:
        call, ch = gateway_generate(stack["gateway"].addr, sampling=common_pb2.SamplingParams(max_new_tokens=4))
        speculative = list(call)[-1].final.speculative
        ch.close()
        if speculative:
            return time.monotonic() - t0
        assert time.monotonic() - t0 < 20, "the gateway did not speculate on pair A again"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(stack):
    call, ch = gateway_generate(stack["gateway"].addr, no_speculation=True)
    text = "".join(m.text for m in call)
    ch.close()
    return text


def test_reliability_target_killed_draft_fails_fast_and_frees_kv(stack):
    draft_a = stack["draft_a"]
    with grpc.insecure_channel(draft_a.addr) as ch:
        call = draft_pb2_grpc.DraftServiceStub(ch).Generate(draft_pb2.DraftServiceGenerateRequest(
            request_id="dies", prompt_ids=PROMPT_IDS, sampling=LONG), timeout=60)
        it = iter(call)
        next(it)
        stack["target_a"].kill()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(it)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "target" in err.value.details()
        assert time.monotonic() - t0 < 5  # fails fast, does not hang on the dead target
    assert wait_whole(draft_kv, draft_a.addr)[2] == 0
    free, total, _ = draft_kv(draft_a.addr)
    assert free == total
    restart_target_a(stack)
    wait_pairs_up(stack["gateway"].addr, 2)


def test_reliability_target_killed_gateway_continues_on_the_other_pair(stack, reference):
    gateway = stack["gateway"]
    call, ch = gateway_generate(gateway.addr)  # speculative: pair A (the only pair with a draft)
    it = iter(call)
    texts = [next(it).text]
    stack["target_a"].kill()
    msgs = list(it)
    ch.close()
    final = msgs[-1].final
    texts += [m.text for m in msgs]
    assert "".join(texts) == reference  # same greedy text, one stream, nothing lost
    assert final.completion_tokens == 300 and not final.speculative
    assert pairs_up(gateway.addr) == 1  # pair A is marked down
    assert wait_whole(target_kv, stack["target_b"].addr)[2] == 0
    assert wait_whole(draft_kv, stack["draft_a"].addr)[2] == 0
    assert restart_target_a(stack) < 20  # and speculates again once its target answers again
    assert wait_pairs_up(gateway.addr, 2) < 20



def test_reliability_target_restarted_under_the_only_pairs_stream_it_waits_and_goes_on(stack, reference):
    """A gateway over pair A alone: pair A's target is killed under a speculative stream and started again 1 s
    later. With no other pair, the stream waits for pair A to come back (`--pair-wait-seconds`, default 30) and
    ends with the same greedy text in one stream. Before, it ended UNAVAILABLE `no draft/target pair is
    available` the moment the target died."""
    only_a = start_gateway(f"{stack['draft_a'].addr}={stack['target_a'].addr}")
    try:
        call, ch = gateway_generate(only_a.addr)
        it = iter(call)
        texts = [next(it).text]
        stack["target_a"].kill()
        with futures.ThreadPoolExecutor(1) as pool:
            restarted = pool.submit(lambda: (time.sleep(1.0), restart_target_a(stack)))
            msgs = list(it)
            restarted.result(timeout=120)
        ch.close()
    finally:
        only_a.stop()
    final = msgs[-1].final
    texts += [m.text for m in msgs]
    assert "".join(texts) == reference and final.completion_tokens == 300 and final.fallbacks >= 1
    assert wait_whole(draft_kv, stack["draft_a"].addr)[2] == 0
    assert wait_pairs_up(stack["gateway"].addr, 2) < 20


def wait_health(addr: str, service: str, want: int, timeout_s: float = 20.0) -> float:
    t0 = time.monotonic()
    while health(addr, service) != want:
        assert time.monotonic() - t0 < timeout_s, f"{addr} {service!r} not {want} after {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def test_reliability_the_drafts_readiness_follows_its_target(stack, tmp_path, caplog):
    """Pair A's draft reports NOT_SERVING while its target is away and while a target of another shape answers on
    its address (a rolling update to another model: before, the draft stayed SERVING and every request paid a
    Prefill it threw away, QA); SERVING again once its own target is back. Its `liveness` stays SERVING."""
    draft_a, gateway = stack["draft_a"], stack["gateway"]
    stack["target_a"].kill()
    away = wait_health(draft_a.addr, DRAFT_HEALTH, NOT_SERVING)
    assert health(draft_a.addr, "") == NOT_SERVING and health(draft_a.addr, "liveness") == SERVING
    back = restart_target_a(stack)  # the gateway speculates on pair A again: its draft is SERVING
    assert health(draft_a.addr, DRAFT_HEALTH) == SERVING
    other = tmp_path / "wider-target"
    other.mkdir()
    cfg = json.loads((TINY / "target" / "config.json").read_text())
    cfg.update(hidden_size=2 * cfg["hidden_size"])
    (other / "config.json").write_text(json.dumps(cfg))
    shutil.copy(TINY / "target" / "tokenizer.tok.json", other)
    stack["target_a"].kill()
    with caplog.at_level(logging.WARNING, logger="draft_service.target_watch"):
        stack["target_a"] = target_process("--model", str(other), "--load-format", "dummy", port=stack["target_a"].port,
                                           log_dir=stack["logs"]).start().wait_serving("specdec.v1.TargetService")
        wait_health(draft_a.addr, DRAFT_HEALTH, NOT_SERVING)
        deadline = time.monotonic() + 10  # (the line comes after the target answered, maybe after "does not answer")
        while not any("does not match --target-model" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.1)
    stack["target_a"].kill()
    restart_target_a(stack)
    assert health(draft_a.addr, DRAFT_HEALTH) == SERVING and wait_pairs_up(gateway.addr, 2) < 20
    print(f"the draft NOT_SERVING {away:.1f} s after its target died; the gateway speculating on it {back:.1f} s "
          "after the target came back")


def test_reliability_target_frozen_gateway_moves_on_and_the_target_frees_its_pages(stack, reference):
    """SIGSTOP of pair A's target under a speculative gateway stream: once its health checks go unanswered the
    stream leaves pair A and continues on pair B with the same greedy text (before: the draft's 60 s call timeout,
    then UNAVAILABLE on one pair). After SIGCONT the target's pages come back (the draft's request is aborted;
    what no call names again is released by the target's idle sweep)."""
    gateway, target_a = stack["gateway"], stack["target_a"]
    call, ch = gateway_generate(gateway.addr)  # speculative: pair A
    it = iter(call)
    texts = [next(it).text]
    os.kill(target_a.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    msgs, arrived = [], [t0]
    try:
        for msg in it:
            msgs.append(msg)
            arrived.append(time.monotonic())
    finally:
        os.kill(target_a.proc.pid, signal.SIGCONT)
    ch.close()
    texts += [m.text for m in msgs]
    assert "".join(texts) == reference and not msgs[-1].final.speculative
    moved_in = max(b - a for a, b in zip(arrived[:-1], arrived[1:], strict=True))  # the stream's longest stall
    assert moved_in < 15, moved_in  # a check every 2 s, then every 0.25 s + its 1 s deadline: three unanswered
    free, total, running = wait_whole(target_kv, target_a.addr, timeout_s=30)
    assert (free, running) == (total, 0)
    assert wait_whole(draft_kv, stack["draft_a"].addr, timeout_s=30)[2] == 0
    assert wait_pairs_up(gateway.addr, 2) < 20
    print(f"frozen target: the stream moved on after {moved_in:.1f} s")


def test_reliability_a_target_frozen_past_its_idle_limit_keeps_a_live_drafts_requests(tmp_path):
    """SIGSTOP of a target with --request-idle-seconds 2 for 4 s under a draft's stream: as it wakes it must not
    take the live draft's request for abandoned (its Verify waited through the freeze); the stream ends with the
    greedy text. Before, the first sweep after the freeze released it: NOT_FOUND, 3 of 3 in a QA run."""
    target = target_process("--request-idle-seconds", "2", log_dir=tmp_path).start() \
        .wait_serving("specdec.v1.TargetService")
    draft = start_draft(target.addr)
    try:
        with grpc.insecure_channel(draft.addr) as ch:
            stub = draft_pb2_grpc.DraftServiceStub(ch)

            def generate(rid):
                return stub.Generate(draft_pb2.DraftServiceGenerateRequest(
                    request_id=rid, prompt_ids=PROMPT_IDS, sampling=LONG), timeout=120)

            reference = [t for m in generate("uninterrupted") for t in m.token_ids]
            it = iter(generate("frozen"))
            tokens = list(next(it).token_ids)
            os.kill(target.proc.pid, signal.SIGSTOP)
            time.sleep(4)
            os.kill(target.proc.pid, signal.SIGCONT)
            tokens += [t for m in it for t in m.token_ids]
        assert tokens == reference
        assert "released" not in target.log()
    finally:
        draft.stop()
        target.kill()


def test_reliability_client_deadline_cancels_downstream(stack):
    gateway = stack["gateway"]
    sampling = common_pb2.SamplingParams(max_new_tokens=2000, ignore_eos=True)
    call, ch = gateway_generate(gateway.addr, timeout=1.0, sampling=sampling)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    ch.close()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 3
    # the draft and its target stop the request and free its pages (the deadline travelled downstream)
    free, total, running = wait_whole(draft_kv, stack["draft_a"].addr, timeout_s=5)
    assert (free, running) == (total, 0)
    free, total, running = wait_whole(target_kv, stack["target_a"].addr, timeout_s=5)
    assert (free, running) == (total, 0)


# ---- a target that answers with malformed features --------------------------------------------------------
class CorruptingTarget(target_pb2_grpc.TargetServiceServicer):
    """Forwards to a real target; `mode` corrupts the features of Prefill or Verify replies."""

    def __init__(self, addr: str):
        self.channel = grpc.insecure_channel(addr)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        self.mode = ""

    def _corrupt(self, reply):
        t = reply.features
        if self.mode.endswith("dim") and t.shape:
            t.shape[-1] -= 1
            t.data = t.data[: len(t.data) // (t.shape[-1] + 1) * t.shape[-1]]  # consistent bytes, wrong width
        elif self.mode.endswith("rows") and t.shape:
            row = len(t.data) // t.shape[0]
            t.shape[0] -= 1
            t.data = t.data[:-row]
        return reply

    def Prefill(self, request, context):
        reply = self.stub.Prefill(request)
        return self._corrupt(reply) if self.mode.startswith("prefill") else reply

    def Verify(self, request, context):
        reply = self.stub.Verify(request)
        return self._corrupt(reply) if self.mode.startswith("verify") else reply

    def Release(self, request, context):
        return self.stub.Release(request)

    def GetModelInfo(self, request, context):
        return self.stub.GetModelInfo(request)


@pytest.fixture(scope="module")
def corrupt_stack(stack):
    proxy = CorruptingTarget(stack["target_b"].addr)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    target_pb2_grpc.add_TargetServiceServicer_to_server(proxy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    draft = start_draft(f"127.0.0.1:{port}")
    yield proxy, draft
    draft.stop()
    server.stop(0)
    proxy.channel.close()


@pytest.mark.parametrize("mode", ["prefill-dim", "prefill-rows", "verify-dim", "verify-rows"])
def test_reliability_malformed_features_from_the_target(stack, corrupt_stack, mode):
    proxy, draft = corrupt_stack
    proxy.mode = mode
    req = draft_pb2.DraftServiceGenerateRequest(request_id=f"bad-{mode}", prompt_ids=PROMPT_IDS, sampling=LONG)
    with grpc.insecure_channel(draft.addr) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, timeout=60))
        assert err.value.code() == grpc.StatusCode.INTERNAL and "malformed" in err.value.details()
        proxy.mode = ""
        ok = [t for m in stub.Generate(draft_pb2.DraftServiceGenerateRequest(
            request_id=f"ok-{mode}", prompt_ids=PROMPT_IDS, sampling=common_pb2.SamplingParams(
                max_new_tokens=20, ignore_eos=True)), timeout=60) for t in m.token_ids]
    assert len(ok) == 20  # the draft service still works
    assert wait_whole(draft_kv, draft.addr)[2] == 0
    free, total, running = wait_whole(target_kv, stack["target_b"].addr)
    assert (free, running) == (total, 0)  # the target's copy of the broken request was released
