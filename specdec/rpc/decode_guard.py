"""Refuse a request whose bytes do not parse with INVALID_ARGUMENT, instead of grpc's UNKNOWN and traceback.

grpc runs a handler's `request_deserializer` (protobuf's `FromString`) before any behaviour, and an exception
there (a DecodeError: "String field had bad UTF-8", "Wire format was corrupt") ends the call UNKNOWN,
"Unexpected <class 'DecodeError'>", and writes an ERROR with a full traceback to the log: one per request, so
any client could flood it. Here each unary-request handler is rebuilt: its deserializer returns a
`MalformedRequest` where the original raised, and its behaviour aborts with INVALID_ARGUMENT on one. The log
gets one WARNING per `WARN_EVERY_S` at most, with how many were refused.

Streaming-request handlers are left as they are (no specdec service has one; reflection's ServerReflectionInfo
does): their messages are parsed one by one while the behaviour iterates, so a check would have to wrap the
iterator rather than the call.

Handlers with their own (de)serializers compose: `wire.add_servicer`'s response serializer (which passes
pre-encoded bytes through) is kept, and only the request side is wrapped.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import grpc
import grpc.aio

from specdec.rpc.handlers import around, behaviour_of, rebuilt

log = logging.getLogger(__name__)

WARN_EVERY_S = 10.0
MAX_REASON_CHARS = 200  # the status details echo the parser's error, never the client's bytes


@dataclass(frozen=True)
class MalformedRequest:
    """What the guarded deserializer returns for bytes that do not parse: the parser's error, one line."""

    reason: str


class DecodeGuard(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self._num_unreported = 0
        self._next_warning_s = 0.0

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler  # None: raw bytes, nothing to parse
        method = handler_call_details.method
        return rebuilt(handler, self._checked(behaviour_of(handler), method),
                       request_deserializer=_tolerant(handler.request_deserializer))

    def _checked(self, behaviour, method: str):
        """`behaviour`, run only for a request that parsed; same kind (async generator or coroutine)."""
        @contextlib.asynccontextmanager
        async def parsed(request, context):
            if isinstance(request, MalformedRequest):
                await self._refuse(request, context, method)
            yield
        return around(behaviour, parsed)

    async def _refuse(self, request: MalformedRequest, context, method: str) -> None:
        self._note(method, request.reason)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.reason}")

    def _note(self, method: str, reason: str) -> None:
        """A WARNING for the first refusal, then at most one per WARN_EVERY_S counting those in between."""
        self._num_unreported += 1
        now = time.monotonic()
        if now < self._next_warning_s:
            return
        log.warning("refused %d malformed request(s), the latest to %s: %s", self._num_unreported, method, reason)
        self._num_unreported, self._next_warning_s = 0, now + WARN_EVERY_S


def _tolerant(deserialize):
    """`deserialize`, returning a MalformedRequest where it raises (DecodeError, or anything else a custom
    deserializer may raise on bad bytes, e.g. UnicodeDecodeError)."""
    def deserializer(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:
            return MalformedRequest(_first_line(exc))
    return deserializer


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line[:MAX_REASON_CHARS]
