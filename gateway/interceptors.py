"""Server interceptors of the gateway: access log and metrics (the API-key check is in `auth.py`).

Each one wraps the behaviour of the GatewayService methods only; health checks and reflection pass untouched
(probes carry no API key and should not fill the log). The wrapper runs on every call and sees the request,
the context and, for Generate, every response.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from typing import Any

import grpc
import grpc.aio
from opentelemetry import context as otel_context

from specdec.rpc.drain_gate import drain_message
from specdec.rpc.metadata import left_status, request_id_from
from specdec.telemetry import ServiceMetrics, bind_request_id
from specdec.telemetry.tracing import attached

log = logging.getLogger("gateway.access")

GATEWAY_METHOD_PREFIX = "/specdec.v1.GatewayService/"
MAX_LOGGED_MESSAGE = 300  # characters of a failed call's status message in its access-log line


# ------------------------------------------------------------------------------------------- the base class


class BehaviorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps GatewayService handlers; subclasses override `wrap_unary` and/or `wrap_stream`."""

    def wrap_unary(self, behavior, method: str):
        return behavior

    def wrap_stream(self, behavior, method: str):
        return behavior

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(GATEWAY_METHOD_PREFIX):
            return handler
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self.wrap_unary(handler.unary_unary, method))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self.wrap_stream(handler.unary_stream, method))
        return handler


def status_of(exc: BaseException | None, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status a call ended with, seen from a wrapper around its behaviour."""
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return left_status(context)
    code = context.code()
    if isinstance(code, grpc.StatusCode) and code is not grpc.StatusCode.OK:
        return code
    return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN


class OnEnd:
    """`with OnEnd(context, report):` calls `report(status)` once the block ends, however it ends (`status_of`).
    It keeps no reference to the exception: a wrapper's frame holding the exception it re-raises is in that
    exception's traceback, a cycle that kept a refused call's request alive until a full garbage collection."""

    def __init__(self, context: grpc.aio.ServicerContext, report) -> None:
        self._context, self._report = context, report

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> bool:
        self._report(status_of(exc, self._context))
        return False


def incoming_request_id(request: Any, context: grpc.aio.ServicerContext) -> str | None:
    return getattr(request, "request_id", "") or request_id_from(context)


# the request id a call goes by once the servicer named it (one it generated), for the call's access-log line: a
# stream that ends without its final stats (cancelled) logged `request_id: null` while the draft's line had the id
_NAMED_ID: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("specdec_named_request_id", default=None)


def name_request_id(request_id: str) -> None:
    """Tell the access log which request id this call goes by (from inside the handler)."""
    named = _NAMED_ID.get()
    if named is not None:
        named[:] = [request_id]


# ------------------------------------------------------------------------------------------- logging


class AccessLogInterceptor(BehaviorInterceptor):
    """One line per call: method, status, duration; stamped with the request id."""

    def wrap_unary(self, behavior, method: str):
        async def logged(request, context):
            started = time.monotonic()
            with bind_request_id(incoming_request_id(request, context)), \
                    OnEnd(context, lambda code: _log_call(method, code, started, why=_details(context))):
                return await behavior(request, context)

        return logged

    def wrap_stream(self, behavior, method: str):
        async def logged(request, context):
            started, count, final = time.monotonic(), 0, None
            # the call's trace, for its line: a stream the client cancelled is closed from outside the call's
            # context (its line lacked the trace id, 3 of 9 cancelled streams in QA)
            call_context = otel_context.get_current()
            named: list[str] = []
            _NAMED_ID.set(named)  # (this call's own context: the handler runs in it)

            def report(code: grpc.StatusCode) -> None:
                # a request id the gateway generated: the servicer named it before any response
                rid = incoming_request_id(request, context) or next(iter(named), None)
                with attached(call_context), bind_request_id(rid):
                    _log_call(method, code, started, count, final, _details(context))

            with bind_request_id(incoming_request_id(request, context)), OnEnd(context, report):
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        count += 1
                        if final is None and _has_final(response):
                            final = response.final
                        yield response

        return logged


def _has_final(response: Any) -> bool:
    try:
        return response.HasField("final")
    except ValueError:  # a message without a `final` field
        return False


def _details(context: grpc.aio.ServicerContext) -> str:
    """The message the call ended with, if it set one (an abort's: why a request was refused), or the drain's that
    ended it (set on the context only after this wrapper saw the cancel)."""
    try:
        details = context.details()
    except Exception:  # noqa: BLE001 - a context that cannot tell: the line goes without it
        details = ""
    details = details.decode(errors="replace") if isinstance(details, bytes) else (details or "")
    return details or drain_message(context) or ""


def _log_call(
    method: str, code: grpc.StatusCode, started: float, num_responses: int | None = None, final: Any = None,
    why: str = "",
) -> None:
    """One line per call; a Generate that finished adds its tokens, tau and timings (`GatewayStats`); a call that
    failed, its status message (`why`: the reason a request was refused, lost with tracing off before)."""
    extra = {"rpc_method": method, "grpc_status": code.name, "duration_s": round(time.monotonic() - started, 4)}
    if why and code is not grpc.StatusCode.OK:
        extra["grpc_message"] = why[:MAX_LOGGED_MESSAGE]
    streamed = "" if num_responses is None else f", {num_responses} messages"
    if final is not None:
        extra.update(prompt_tokens=final.prompt_tokens, completion_tokens=final.completion_tokens,
                      tau=round(final.tau, 3), accepted_per_position=list(final.accepted_per_position),
                      ttft_s=round(final.time_to_first_token_s, 4), speculative=final.speculative,
                      fallbacks=final.fallbacks)
        streamed += (f", {final.prompt_tokens} prompt + {final.completion_tokens} new tokens, tau {final.tau:.2f}, "
                     f"ttft {final.time_to_first_token_s:.3f} s")
        if final.fallbacks:
            streamed += f", {final.fallbacks} fallback{'s' * (final.fallbacks > 1)}"
    if "grpc_message" in extra:
        streamed += f": {extra['grpc_message']!r}"
    level = logging.INFO if code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED) else logging.WARNING
    log.log(level, "%s %s in %.3f s%s", method, code.name, extra["duration_s"], streamed, extra=extra)


# ------------------------------------------------------------------------------------------- metrics


class MetricsInterceptor(BehaviorInterceptor):
    """Generate streams: running gauge, request counts by status, TTFT, time per output token, latency."""

    FAMILIES = frozenset({"requests", "running", "fallbacks"})  # the groups it sets: the gateway registers these

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._metrics = metrics
        self._running = 0

    def wrap_stream(self, behavior, method: str):
        async def measured(request, context):
            started, first_text_s, final, generated = time.monotonic(), None, None, 0

            def report(code: grpc.StatusCode) -> None:
                self._set_running(-1)
                self._observe(code, time.monotonic() - started, first_text_s, final)
                # a refused request has no final stats: its prompt was not served (tokens streamed: none)
                self._metrics.count_tokens(final.prompt_tokens if final is not None else 0, generated)

            self._set_running(+1)
            with OnEnd(context, report):
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        if first_text_s is None and getattr(response, "text", ""):
                            first_text_s = time.monotonic() - started
                        generated += len(response.token_ids)
                        if response.HasField("final"):
                            final = response.final
                        yield response

        return measured

    def _set_running(self, delta: int) -> None:
        self._running += delta
        self._metrics.set_running(self._running)

    def _observe(self, code: grpc.StatusCode, e2e_s: float, ttft_s: float | None, final: Any) -> None:
        tpot_s = None
        if ttft_s is not None and final is not None and final.completion_tokens > 1:
            tpot_s = (e2e_s - ttft_s) / (final.completion_tokens - 1)
        self._metrics.observe_request(code.name, ttft_s=ttft_s, tpot_s=tpot_s, e2e_s=e2e_s)
        if final is not None and final.fallbacks:
            self._metrics.count_fallbacks(final.fallbacks)
