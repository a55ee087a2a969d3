"""A target with a verify lane (`--verify-lane-port`) and a draft that uses it: the draft's Verify calls take the
lane, their results are gRPC's to the byte, statuses and failures read as over gRPC, and a lane that cannot be
reached leaves the calls on gRPC."""

from __future__ import annotations

import asyncio
import logging
import socket
from types import SimpleNamespace

import grpc
import pytest
from cert_factory import make_certs
from services_stack import start_draft, start_target

import specdec.rpc.lane_client as lane_client
from draft_service.target_client import TargetClient
from specdec.engine.requests import PrefillInput, VerifyInput
from specdec.errors import InvalidInput, NotReady, UnknownRequest
from specdec.rpc.channel import make_channel
from specdec.sampling_params import SamplingParams
from specdec.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


@pytest.fixture(scope="module")
def target():
    service = start_target("--num-pages", "400", "--max-batch-size", "16", "--verify-lane-port", "0")
    yield service
    service.stop()


@pytest.fixture
def lane_calls(monkeypatch) -> list[str]:
    """The methods of the calls sent over any verify lane (this process's)."""
    sent, start = [], lane_client.LaneClient.start

    def counted(self, method, *args, **kwargs):
        sent.append(method)
        return start(self, method, *args, **kwargs)

    monkeypatch.setattr(lane_client.LaneClient, "start", counted)
    return sent


def _client(target, lane: bool) -> TargetClient:
    client = TargetClient(target.addr, timeout_s=10.0)
    info = client.model_info()
    assert info.verify_lane_port > 0
    if not lane:
        client.lane.close()
    return client


def _steps(client: TargetClient, rid: str, prompt: list[int]) -> list:
    """A prefill, then verifies of chains and trees built from the target's own greedy tokens and guesses."""
    first = client.prefill([PrefillInput(rid, prompt, SamplingParams(max_new_tokens=60))])[0]
    outs, nxt = [first.first_token], first.first_token
    for depth in range(1, 7):
        tokens = [(nxt * 7 + i) % 500 + 3 for i in range(depth)]
        parents = list(range(-1, depth - 1)) if depth % 2 else [-1] * depth  # chains and one-level trees
        out = client.verify([VerifyInput(rid, tokens, parents)])[0]
        outs.append((out.tokens, out.finish_reason, out.features.float().sum().item() if out.features is not None
                     else None))
        nxt = out.tokens[-1]
    client.release(rid)
    return outs


def test_verify_calls_take_the_lane_and_answer_as_grpc_does(target, lane_calls, dev_prompts, tiny_tokenizer):
    prompt = tiny_tokenizer.encode(dev_prompts[3])[-60:]
    over_lane, over_grpc = _client(target, lane=True), _client(target, lane=False)
    try:
        by_lane = _steps(over_lane, "lane-a", prompt)
        assert lane_calls.count("/specdec.v1.TargetService/Verify") == 6
        lane_calls.clear()
        by_grpc = _steps(over_grpc, "grpc-a", prompt)
        assert lane_calls == []
        assert by_lane == by_grpc
        # statuses: the engine's errors come back as the same exceptions and messages
        for client in (over_lane, over_grpc):
            with pytest.raises(UnknownRequest, match="'nobody'"):
                client.verify([VerifyInput("nobody", [5], [-1])])
        client = over_lane
        client.prefill([PrefillInput("bad", prompt, SamplingParams(max_new_tokens=8))])
        with pytest.raises(InvalidInput) as lane_err:
            over_lane.verify([VerifyInput("bad", [5, 6], [-1, 5])])
        with pytest.raises(InvalidInput) as grpc_err:
            over_grpc.verify([VerifyInput("bad", [5, 6], [-1, 5])])
        assert str(lane_err.value) == str(grpc_err.value)
        client.release("bad")
    finally:
        over_lane.close()
        over_grpc.close()


def test_greedy_streams_through_a_draft_on_the_lane_equal_target_generate(target, lane_calls, dev_prompts,
                                                                          tiny_tokenizer):
    draft = start_draft(target.addr, "--num-steps", "4", "--topk", "2", "--num-draft-tokens", "6",
                        "--max-batch-size", "16")
    prompts = [tiny_tokenizer.encode(p)[-(30 + 5 * i):] for i, p in enumerate(dev_prompts[40:48])]

    async def one(i: int, prompt: list[int]):
        async with make_channel(draft.addr) as dch, make_channel(target.addr) as tch:
            sampling = {"max_new_tokens": 12 + 2 * i}
            spec = draft_pb2_grpc.DraftServiceStub(dch).Generate(draft_pb2.DraftServiceGenerateRequest(
                request_id=f"lane-{i}", prompt_ids=prompt, sampling=sampling))
            plain = target_pb2_grpc.TargetServiceStub(tch).Generate(target_pb2.TargetServiceGenerateRequest(
                request_id=f"plain-{i}", prompt_ids=prompt, sampling=sampling))
            return [t async for m in spec for t in m.token_ids], [t async for m in plain for t in m.token_ids]

    async def run():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    try:
        for spec_tokens, plain_tokens in asyncio.run(run()):
            assert spec_tokens == plain_tokens and spec_tokens
        assert lane_calls.count("/specdec.v1.TargetService/Verify") > len(prompts)
    finally:
        draft.stop()


def test_a_lane_that_cannot_be_reached_leaves_verify_on_grpc(target, caplog, dev_prompts, tiny_tokenizer):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]  # bound, never listening: a firewall's or a Service's missing port
    client = _client(target, lane=True)
    client.lane.told(closed)
    try:
        with caplog.at_level(logging.WARNING, logger="draft_service.verify_lane"):
            steps = _steps(client, "unreached", tiny_tokenizer.encode(dev_prompts[5])[-40:])
        assert len(steps) == 7
        assert sum("Verify calls go over gRPC" in r.getMessage() for r in caplog.records) == 1  # once, not a step
    finally:
        client.close()


def test_a_target_that_stops_fails_lane_calls_as_a_target_away(dev_prompts, tiny_tokenizer):
    service = start_target("--num-pages", "200", "--verify-lane-port", "0")
    client = _client(service, lane=True)
    nudged: list[int] = []
    client.on_unreachable = lambda: nudged.append(1)
    try:
        client.prefill([PrefillInput("gone", tiny_tokenizer.encode(dev_prompts[6])[-30:],
                                     SamplingParams(max_new_tokens=30))])
        client.verify([VerifyInput("gone", [5], [-1])])
        client.release("gone")
        service.stop()
        with pytest.raises(NotReady) as err:
            client.verify([VerifyInput("gone", [5], [-1])])
        assert str(err.value).startswith("target: ") and nudged
    finally:
        client.close()


def test_a_lane_with_tls_is_refused_at_start(tmp_path):
    certs = make_certs(tmp_path)
    with pytest.raises(RuntimeError, match="verify lane is plaintext"):
        start_target("--verify-lane-port", "0", f"--tls-cert={certs['server']}.pem",
                     f"--tls-key={certs['server']}.key")


def test_the_lane_and_grpc_port_must_differ():
    with pytest.raises(RuntimeError, match="also this target's gRPC or metrics port"):
        start_target("--verify-lane-port", "50999", "--metrics-port", "50999")


def test_lane_calls_and_grpc_calls_refuse_the_same_garbage(target):
    """Bytes that are no VerifyRequest: INVALID_ARGUMENT either way (the decode guard runs on the lane too)."""
    client = _client(target, lane=True)
    lane = lane_client.LaneClient("127.0.0.1", client.lane.client.port, 1 << 20)
    client.close()
    with pytest.raises(grpc.RpcError) as err:
        lane.call("/specdec.v1.TargetService/Verify", b"\xff\xff\xff", 5.0)
    lane.close()
    channel = grpc.insecure_channel(target.addr)
    raw = channel.unary_unary("/specdec.v1.TargetService/Verify", request_serializer=None,
                              response_deserializer=None)
    with pytest.raises(grpc.RpcError) as grpc_err:
        raw(b"\xff\xff\xff", timeout=5.0)
    channel.close()
    assert err.value.code() == grpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == grpc_err.value.details()



def _frozen_lane() -> tuple[socket.socket, int]:
    """A lane that greets and then never answers (its port cut off past the handshake, a frozen proxy)."""
    import threading

    from specdec.rpc.lane import MAGIC

    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.recv(len(MAGIC), socket.MSG_WAITALL)
            conn.sendall(MAGIC)  # then reads nothing, answers nothing

    threading.Thread(target=serve, daemon=True).start()
    return listener, listener.getsockname()[1]


def test_a_lane_that_stops_answering_while_grpc_answers_is_left_by_the_target_watch(target, caplog, dev_prompts,
                                                                                     tiny_tokenizer):
    """QA: a lane cut off alone (gRPC fine) held a step for its 60 s deadline. The watch's probes find it: the call
    under way ends UNAVAILABLE (its requests fail over, as when gRPC is cut off) and later calls go over gRPC."""
    import threading

    listener, port = _frozen_lane()
    client = _client(target, lane=True)
    client.lane.told(port)
    client.prefill([PrefillInput("frozen", tiny_tokenizer.encode(dev_prompts[7])[-30:],
                                 SamplingParams(max_new_tokens=30))])
    errors: list[BaseException] = []

    def stuck_call() -> None:
        try:
            client.verify([VerifyInput("frozen", [5], [-1])])
        except BaseException as exc:  # noqa: BLE001 - what the call ended with
            errors.append(exc)

    caller = threading.Thread(target=stuck_call)
    try:
        caller.start()
        with caplog.at_level(logging.WARNING, logger="draft_service.verify_lane"):
            for _ in range(2):
                client.probe_lane(0.3)
        caller.join(5)
        assert not caller.is_alive() and isinstance(errors[0], NotReady)  # ended now, not at its 10 s deadline
        assert any("does not answer while the target's gRPC port does" in r.getMessage() for r in caplog.records)
        out = client.verify([VerifyInput("frozen", [5], [-1])])  # over gRPC (the stuck call committed nothing)
        assert out[0].tokens
    finally:
        listener.close()
        client.release("frozen")
        client.close()


def test_a_lane_refused_while_its_target_was_away_is_tried_again_once_the_target_answers(caplog):
    """QA: a draft whose step came as its target's drain ended found the lane refused, logged a WARNING about a
    Kubernetes Service and left the lane for 60 s; the target restarted on the same lane port (the chart's 50062)
    and told of it in GetModelInfo, but a port already known changed nothing, so Verify stayed on gRPC for the
    rest of the minute. The target watch's finding the target back now tries the lane at the next call."""
    from draft_service.target_watch import TargetWatch
    from draft_service.verify_lane import VerifyLane
    from specdec.rpc.lane import MAGIC

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens: the target is away
    lane = VerifyLane(f"127.0.0.1:{port}", plaintext=True)
    lane.told(port)
    with caplog.at_level(logging.WARNING, logger="draft_service.verify_lane"):
        assert lane.for_call() is None  # refused: Verify goes over gRPC
    listener = socket.create_server(("127.0.0.1", port))  # the target back, its lane on the same port
    import threading

    def greet() -> None:
        conn, _ = listener.accept()
        conn.recv(len(MAGIC), socket.MSG_WAITALL)
        conn.sendall(MAGIC)

    threading.Thread(target=greet, daemon=True).start()

    class Client:  # the TargetClient's part the watch uses
        addr = f"127.0.0.1:{port}"
        answers = [NotReady("target: refused"), NotReady("target: refused"), SimpleNamespace(model="tiny")]

        def renew_channel(self):
            pass

        def abandon_calls(self, why):
            pass

        def model_info(self, timeout_s=None):
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            lane.told(port)  # GetModelInfo tells the same port again
            return answer

        def target_back(self):
            lane.retry_now()

    watch = TargetWatch(Client(), lambda info: None, interval_s=0.0, misses_down=2)

    async def looks() -> None:
        async def set_ready(up: bool) -> None:
            pass
        for _ in range(3):
            await watch.check(set_ready)

    try:
        asyncio.run(looks())
        assert watch.down is None
        assert lane.for_call() is not None  # the lane again, not gRPC for the rest of the minute
    finally:
        lane.close()
        listener.close()
