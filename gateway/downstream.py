"""Clients of one pair's services: protobuf in, plain `Chunk`s out.

`TargetClient.generate` (plain decoding) and `DraftClient.generate` (speculative) stream the same thing: token
id deltas, the last one carrying a `Finish`. Errors surface as `grpc.aio.AioRpcError`; `is_backend_failure`
tells a service that is down or broke from a request the service refused (which no retry would fix).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import SpecdecError
from specdec.rpc.channel import make_channel
from specdec.rpc.metadata import request_id_metadata
from specdec.rpc.peer_protocol import not_grpc, not_grpc_text
from specdec.rpc.sampling_codec import sampling_to_proto
from specdec.rpc.tls import TlsConfig
from specdec.rpc.tls_reload import tls_watch
from specdec.sampling_params import SamplingParams
from specdec.telemetry.grpc_tracing import client_interceptors
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

TARGET_SERVICE = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
DRAFT_SERVICE = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name

# Status codes that mean "this service is down or broke", not "this request is bad": the gateway falls back.
# CANCELLED here is the service's, never the gateway's own (a cancel of ours raises asyncio's CancelledError in the
# reader): a grpc server that stops cancels the calls it has taken and not yet handed to a handler, so a stream
# opened on a draft or target in the last moments of its drain ended with CANCELLED, which reached the client
# (QA: a rolling restart under load).
FAILURE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                           grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED})


@dataclass(frozen=True)
class Finish:
    """How a downstream generation ended; tau and acceptance only from a draft."""

    reason: int  # common_pb2.FinishReason value
    tau: float = 0.0
    accepted_per_position: tuple[int, ...] = ()


@dataclass(frozen=True)
class Chunk:
    token_ids: tuple[int, ...]
    finish: Finish | None = None


class StreamBroken(SpecdecError):
    """A downstream stream ended without a finish, or was aborted by the service itself."""

    status = "UNAVAILABLE"


def is_backend_failure(exc: BaseException) -> bool:
    if isinstance(exc, StreamBroken):
        return True
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in FAILURE_CODES


def open_channel(addr: str, tls: TlsConfig | None, credentials: grpc.ChannelCredentials | None = None
                 ) -> grpc.aio.Channel:
    """`make_channel`, plus the tracing interceptors when tracing is on (none when off)."""
    return make_channel(addr, tls, interceptors=client_interceptors(), credentials=credentials)


class Health(enum.Enum):
    SERVING = "serving"
    NOT_SERVING = "not serving"  # it answered NOT_SERVING: loading, draining, or its own backend away
    FAILED = "failed"  # the check failed: nothing listens there (connection refused), TLS, DNS, ...
    WRONG_SERVICE = "wrong service"  # it answers, but not the expected service (or not gRPC): another kind of server
    NO_ANSWER = "no answer"  # the deadline passed
    STALLED = "stalled"  # it answered UNKNOWN: its engine thread is stuck in one step (`specdec.serving.stall_watch`)
    MISFIT = "misfit"  # a target serving a model of another vocabulary than the gateway's tokenizer (`Router`)


# a health check's status that means "this server does not serve that name": no health service at all, or a
# health service that does not know the name (a draft address that is really a target's answers NOT_FOUND)
_WRONG_SERVICE_CODES = frozenset({grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.NOT_FOUND})
MAX_WHY_DETAILS = 200  # characters of a failed check's status message in `HealthCheck.why`
# how long a channel replaced by `renew_channel` lets its streams finish (a 4096-token stream of a slow model is
# minutes) before it cancels what is left
RETIRE_S = 3600.0


@dataclass(frozen=True)
class HealthCheck:
    """What one health check found: `health`, and `why` in words for the log ("connection refused
    (UNAVAILABLE: ...)", "not serving (it answered NOT_SERVING)", ...)."""

    health: Health
    why: str = ""


class _ServiceClient:
    service_name = ""

    def __init__(self, addr: str, tls: TlsConfig | None = None) -> None:
        self.addr, self.tls = addr, tls
        self._tls_files = tls_watch(tls, f"channel to {addr}") if tls is not None else None
        self._retiring: dict[asyncio.Task, grpc.aio.Channel] = {}  # renewed channels closing after their calls
        self._use(open_channel(addr, tls, self._tls_files.taken.channel_credentials() if tls is not None else None))

    def _use(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self._health = health_pb2_grpc.HealthStub(channel)

    def renew_channel(self) -> None:
        """A new channel when the TLS files changed (a renewed certificate: the old one is refused by the server
        once it expires); the old channel's calls finish on it, and it closes after them or `RETIRE_S`."""
        material = self._tls_files.changed() if self._tls_files is not None else None
        if material is None:
            return
        old = self.channel
        self._use(open_channel(self.addr, self.tls, material.channel_credentials()))
        task = asyncio.create_task(old.close(grace=RETIRE_S), name=f"retire-channel-{self.addr}")
        self._retiring[task] = old
        task.add_done_callback(self._retiring.pop)

    async def probe(self, timeout_s: float = 1.0) -> HealthCheck:
        """One health check: SERVING; NOT_SERVING (an answer saying so); STALLED (UNKNOWN: its engine is stuck in
        one step, so its streams wait for nothing); WRONG_SERVICE (the server does not know
        this service's name: another kind of service, e.g. a target where the draft should be); FAILED (any other
        error but a deadline: a service that is gone refuses the connection at once); or NO_ANSWER (the deadline
        passed: a busy service, whose event loop waits behind a long engine step on a small CPU, misses one now
        and then)."""
        request = health_pb2.HealthCheckRequest(service=self.service_name)
        try:
            reply = await self._health.Check(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            return self._failed_check(exc, timeout_s)
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return HealthCheck(Health.SERVING, "serving")
        if reply.status == health_pb2.HealthCheckResponse.UNKNOWN:
            return HealthCheck(Health.STALLED, "stalled (it answered UNKNOWN: its engine has been in one step past "
                                               "its --engine-stall-seconds)")
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        return HealthCheck(Health.NOT_SERVING, f"not serving (it answered {status})")

    def _failed_check(self, exc: grpc.aio.AioRpcError, timeout_s: float) -> HealthCheck:
        code, details = exc.code(), exc.details() or ""
        status = f"{code.name}: {details[:MAX_WHY_DETAILS]}" if details else code.name
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return HealthCheck(Health.NO_ANSWER, f"no answer within {timeout_s:g} s")
        if code in _WRONG_SERVICE_CODES:
            return HealthCheck(Health.WRONG_SERVICE, f"does not implement {self.service_name} (its health check "
                                                     f"answered {status}; --pair is DRAFT=TARGET)")
        if not_grpc(code, details):
            return HealthCheck(Health.WRONG_SERVICE, f"{not_grpc_text('it')} ({status})")
        what = "connection refused" if "connection refused" in details.lower() else "health check failed"
        return HealthCheck(Health.FAILED, f"{what} ({status})")

    async def close(self) -> None:
        await self.channel.close()
        for task, channel in list(self._retiring.items()):
            task.cancel()
            await channel.close()


class TargetClient(_ServiceClient):
    service_name = TARGET_SERVICE

    def _use(self, channel: grpc.aio.Channel) -> None:
        super()._use(channel)
        self._stub = target_pb2_grpc.TargetServiceStub(channel)

    async def model_info(self, timeout_s: float = 2.0) -> target_pb2.TargetServiceGetModelInfoResponse:
        return await self._stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(), timeout=timeout_s)

    async def release(self, request_ids: Sequence[str], timeout_s: float = 2.0) -> None:
        """Best effort: free requests a broken draft left behind (errors are ignored)."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self._stub.Release(target_pb2.ReleaseRequest(request_ids=list(request_ids)), timeout=timeout_s)

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams, timeout_s: float | None
    ) -> AsyncIterator[Chunk]:
        request = target_pb2.TargetServiceGenerateRequest(
            request_id=request_id, prompt_ids=list(prompt_ids), sampling=sampling_to_proto(sampling)
        )
        call = self._stub.Generate(request, timeout=timeout_s, metadata=request_id_metadata(request_id))
        finished = False
        try:
            async for msg in call:
                finished = msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                yield Chunk(tuple(msg.token_ids), Finish(msg.finish_reason) if finished else None)
        finally:
            if not finished:  # left early (client gone, stop string): the target aborts it and frees its KV
                call.cancel()


class DraftClient(_ServiceClient):
    service_name = DRAFT_SERVICE

    def _use(self, channel: grpc.aio.Channel) -> None:
        super()._use(channel)
        self._stub = draft_pb2_grpc.DraftServiceStub(channel)

    async def model_info(self, timeout_s: float = 2.0) -> draft_pb2.DraftServiceGetModelInfoResponse:
        return await self._stub.GetModelInfo(draft_pb2.DraftServiceGetModelInfoRequest(), timeout=timeout_s)

    async def generate(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        timeout_s: float | None,
        spec: common_pb2.SpecParams | None = None,
    ) -> AsyncIterator[Chunk]:
        request = draft_pb2.DraftServiceGenerateRequest(
            request_id=request_id, prompt_ids=list(prompt_ids), sampling=sampling_to_proto(sampling), spec=spec
        )
        call = self._stub.Generate(request, timeout=timeout_s, metadata=request_id_metadata(request_id))
        finished = False
        try:
            async for msg in call:
                finish = None
                if msg.HasField("final"):
                    final, finished = msg.final, True
                    finish = Finish(final.finish_reason, final.tau, tuple(final.accepted_per_position))
                yield Chunk(tuple(msg.token_ids), finish)
        finally:
            if not finished:  # left early: cancelling aborts the request on the draft and the target
                call.cancel()
