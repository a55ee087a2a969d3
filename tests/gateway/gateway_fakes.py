"""Fake DraftService / TargetService servicers on loopback, and a gateway in front of them, for gateway tests.

Both fakes "decode" one scripted token sequence (`FakeModel.script`) deterministically: the k-th generated
token of a request is `script[k]`, whatever the prompt, so a continuation (prompt + tokens so far, id `rid~n`)
goes on exactly where the first attempt stopped, like greedy decoding. The draft sends 3 tokens per chunk
(tau 3), the target one. Each fake records what it saw: requests, deadlines, cancellations, releases.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

import grpc
import grpc.aio

from gateway.config import GatewayConfig, GatewayLimits, PairAddress
from gateway.serve import start_gateway
from specdec.rpc.server import start_server
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc

EOS = 2
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH


@dataclass
class Seen:
    """What one fake service saw."""

    requests: list = field(default_factory=list)  # (request_id, prompt_ids, max_new_tokens)
    deadlines: list = field(default_factory=list)  # seconds left on each Generate call
    cancelled: list = field(default_factory=list)  # request ids whose stream the caller closed
    released: list = field(default_factory=list)
    running: set = field(default_factory=set)
    refused: list = field(default_factory=list)  # request ids refused ALREADY_EXISTS


class FakeModel:
    def __init__(self, script: list[int]) -> None:
        self.script = script
        self._prompt_len: dict[str, int] = {}

    def plan(self, request_id: str, prompt_ids, sampling) -> tuple[list[int], int]:
        """The tokens this request generates from here, and its finish reason."""
        base = request_id.split("~")[0]
        done = len(prompt_ids) - self._prompt_len.setdefault(base, len(prompt_ids))
        stop_ids = set(sampling.stop_token_ids) | ({EOS} if not sampling.ignore_eos else set())
        out = []
        for token in self.script[done:]:
            if len(out) == sampling.max_new_tokens:
                return out, LENGTH
            out.append(token)
            if token in stop_ids:
                return out, STOP
        return out, LENGTH


class _Behaviour:
    def __init__(self, model: FakeModel) -> None:
        self.model = model
        self.seen = Seen()
        self.fail_after_chunks: int | None = None  # abort the stream after this many chunks
        self.fail_details = "fake service went away"  # ... saying this
        self.fail_code = grpc.StatusCode.UNAVAILABLE  # ... with this status
        self.hang_after_chunks: int | None = None  # stop producing (until cancelled) after this many chunks
        self.abort_after_chunks: int | None = None  # end with FINISH_REASON_ABORT (an Abort call) after this many
        self.delay_s = 0.0
        self.taken_ids: set[str] = set()  # ids other requests run under: ALREADY_EXISTS (as are running ones)
        self.taken_prefixes: tuple[str, ...] = ()  # ... and every id starting so

    async def stream(self, request, context, chunk_size: int):
        rid = request.request_id
        if rid in self.taken_ids or rid in self.seen.running or rid.startswith(self.taken_prefixes or ("\0",)):
            self.seen.refused.append(rid)
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already running")
        self.seen.requests.append((rid, list(request.prompt_ids), request.sampling.max_new_tokens))
        self.seen.deadlines.append(context.time_remaining())
        tokens, reason = self.model.plan(rid, request.prompt_ids, request.sampling)
        chunks = [tokens[i : i + chunk_size] for i in range(0, len(tokens), chunk_size)] or [[]]
        self.seen.running.add(rid)
        try:
            for n, chunk in enumerate(chunks):
                if n == self.fail_after_chunks:
                    await context.abort(self.fail_code, self.fail_details)
                if n == self.hang_after_chunks:
                    await asyncio.sleep(3600)
                if n == self.abort_after_chunks:
                    yield [], common_pb2.FINISH_REASON_ABORT
                    return
                await asyncio.sleep(self.delay_s)
                yield chunk, (reason if n == len(chunks) - 1 else None)
        except (asyncio.CancelledError, GeneratorExit):
            self.seen.cancelled.append(rid)
            raise
        finally:
            self.seen.running.discard(rid)


class FakeTarget(target_pb2_grpc.TargetServiceServicer, _Behaviour):
    max_context_len = 512
    vocab_size = 0  # GetModelInfo's (0: not said)
    num_layers = 0  # GetModelInfo's (0: not said)
    release_delay_s = 0.0  # a Release answers this late

    async def Generate(self, request, context):
        async for chunk, reason in self.stream(request, context, chunk_size=1):
            yield target_pb2.TargetServiceGenerateResponse(token_ids=chunk, finish_reason=reason or 0)

    async def Release(self, request, context):
        await asyncio.sleep(self.release_delay_s)
        self.seen.released.extend(request.request_ids)
        return target_pb2.ReleaseResponse()

    async def GetModelInfo(self, request, context):
        return target_pb2.TargetServiceGetModelInfoResponse(
            model="fake-target", max_context_len=self.max_context_len, eos_token_ids=[EOS], vocab_size=self.vocab_size,
            num_layers=self.num_layers
        )


class FakeDraft(draft_pb2_grpc.DraftServiceServicer, _Behaviour):
    shape = (5, 1, 5)  # the tree it reports: num_steps, topk, num_draft_tokens
    max_context_len = 0  # the context it reports (0: none reported, as before the field)

    async def Generate(self, request, context):
        async for chunk, reason in self.stream(request, context, chunk_size=3):
            msg = draft_pb2.DraftServiceGenerateResponse(token_ids=chunk)
            if reason is not None:
                stats = draft_pb2.GenerationStats(finish_reason=reason, tau=3.0, accepted_per_position=[5, 4])
                msg.final.CopyFrom(stats)
            yield msg

    async def GetModelInfo(self, request, context):
        steps, topk, nodes = self.shape
        return draft_pb2.DraftServiceGetModelInfoResponse(
            model="fake-draft", spec=common_pb2.SpecParams(num_steps=steps, topk=topk, num_draft_tokens=nodes),
            max_context_len=self.max_context_len)


async def serve_fake(servicer, add, health_name: str, port: int = 0):
    handle = await start_server([lambda s: add(servicer, s)], [health_name], "127.0.0.1", port)
    await handle.set_serving(True)
    return handle


@dataclass
class FakePair:
    target: FakeTarget
    draft: FakeDraft
    target_handle: object
    draft_handle: object

    @property
    def address(self) -> PairAddress:
        return PairAddress(f"127.0.0.1:{self.draft_handle.bound_port}", f"127.0.0.1:{self.target_handle.bound_port}")


async def start_fake_pair(model: FakeModel) -> FakePair:
    target, draft = FakeTarget(model), FakeDraft(model)
    t = await serve_fake(target, target_pb2_grpc.add_TargetServiceServicer_to_server, "specdec.v1.TargetService")
    d = await serve_fake(draft, draft_pb2_grpc.add_DraftServiceServicer_to_server, "specdec.v1.DraftService")
    return FakePair(target, draft, t, d)


@contextlib.asynccontextmanager
async def gateway_over(addresses, model_dir: str, limits: GatewayLimits = GatewayLimits(), api_keys=(),
                       served_model_name: str = "", metrics=None, pair_wait_s: float = 30.0):
    """A gateway over `addresses`, waited until some pair is up; yields (gateway, stub)."""
    config = GatewayConfig(model_dir=model_dir, pairs=tuple(addresses), limits=limits, health_interval_s=0.2,
                           served_model_name=served_model_name, pair_wait_s=pair_wait_s)
    gateway = await start_gateway(config, api_keys=api_keys, metrics=metrics)
    await asyncio.wait_for(gateway.router.any_up.wait(), 10)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}")
    try:
        yield gateway, gateway_pb2_grpc.GatewayServiceStub(channel)
    finally:
        await channel.close()
        await gateway.stop(grace_s=None)


async def until_speculative(gateway, indices=None, timeout_s: float = 10.0) -> None:
    """Wait until the gateway finds those pairs (default: all) speculative, every part up, not only some pair's target
    (`gateway_over`): each pair's checks keep their own pace, and a test that set up pair 0 to fail saw its request go
    to pair 1, whose draft was up first (CI)."""
    pairs = [p for p in gateway.router.pairs if indices is None or p.index in indices]
    for _ in range(int(timeout_s / 0.02)):
        if all(p.speculative for p in pairs):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"pairs {[p.index for p in pairs if not p.speculative]} not speculative in {timeout_s} s")


@contextlib.asynccontextmanager
async def fake_stack(model: FakeModel, model_dir: str, num_pairs: int = 1, **gateway_kwargs):
    """`num_pairs` fake pairs and a gateway over them; yields (pairs, gateway, stub)."""
    pairs = [await start_fake_pair(model) for _ in range(num_pairs)]
    try:
        async with gateway_over([p.address for p in pairs], model_dir, **gateway_kwargs) as (gateway, stub):
            await until_speculative(gateway)
            yield pairs, gateway, stub
    finally:
        for pair in pairs:
            await pair.draft_handle.stop(None)
            await pair.target_handle.stop(None)


async def hanging_stream(pairs, stub):
    """A Generate whose draft hangs after its first chunk, that chunk read: a stream in flight."""
    pairs[0].draft.hang_after_chunks = 1
    call = stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
        prompt="def fib(n):", sampling=common_pb2.SamplingParams(max_new_tokens=100)))
    await call.read()
    return call


def run(coro, timeout_s: float = 30):
    return asyncio.run(asyncio.wait_for(coro, timeout=timeout_s))


async def collect(call):
    """(text, token ids, final stats, number of messages) of a Generate call."""
    text, ids, final, count = "", [], None, 0
    while (msg := await call.read()) is not grpc.aio.EOF:
        text += msg.text
        ids += list(msg.token_ids)
        count += 1
        if msg.HasField("final"):
            final = msg.final
    return text, ids, final, count


async def status_of(call) -> tuple[str, str]:
    """(status code name, details) a Generate stream or a unary call ends with; ("OK", "") when it succeeds."""
    try:
        await collect(call) if isinstance(call, grpc.aio.UnaryStreamCall) else await call
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details()
    return "OK", ""
