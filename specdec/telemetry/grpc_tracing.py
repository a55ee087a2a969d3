"""W3C trace context carried in gRPC metadata, for grpc.aio clients and servers.

    channel = grpc.aio.insecure_channel(addr, interceptors=client_interceptors())
    server = grpc.aio.server(interceptors=server_interceptors(parent_required={VERIFY_METHOD}))

Both functions return [] when tracing is off, so the RPC path then runs exactly as without them.

Client side: a call made while a recording span is current gets a CLIENT span named after the method
(`specdec.v1.TargetService/Verify`) and sends its `traceparent`; a call made outside any trace sends nothing
and records nothing, so a batch loop that is not inside a (sampled) step span creates no spans per RPC.
Server side: each RPC runs inside a SERVER span named after the method whose parent is the caller's context,
with `specdec.request_id` from the request's `request_id` field, else from `x-request-id` metadata.
Methods listed in `parent_required` get a span only when the caller sent a trace context (use it for
per-step RPCs like Verify, whose spans should exist only for sampled steps). `server_span` is the same thing
as a context manager for code that does not use the interceptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Collection, Iterator
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from specdec.rpc.metadata import left_status, request_id_from
from specdec.telemetry.logs import loggable_id
from specdec.telemetry.tracing import active_provider, get_tracer

PROPAGATOR = TraceContextTextMapPropagator()
_PROPAGATED_KEYS = frozenset(PROPAGATOR.fields)  # {"traceparent", "tracestate"}


def client_interceptors(provider: trace.TracerProvider | None = None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for `grpc.aio.*_channel(..., interceptors=...)`; [] when tracing is off."""
    provider = provider or active_provider()
    if provider is None:
        return []
    tracer = get_tracer(provider)
    return [UnaryUnaryTracing(tracer), UnaryStreamTracing(tracer)]


def server_interceptors(
    provider: trace.TracerProvider | None = None, parent_required: Collection[str] = ()
) -> list[grpc.aio.ServerInterceptor]:
    """Interceptors for `grpc.aio.server(interceptors=...)`; [] when tracing is off.

    `parent_required`: full method names (`/pkg.Service/Method`) traced only when the caller sent a context.
    """
    provider = provider or active_provider()
    if provider is None:
        return []
    return [TracingServerInterceptor(get_tracer(provider), {*parent_required, *PROBE_METHODS})]


# Probes and tooling, traced only under a caller's trace (a health check every few seconds is not a trace).
PROBE_METHODS = frozenset({
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.health.v1.Health/List",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
})


# ---------------------------------------------------------------------------------------------- client side


def _method_name(method: str | bytes) -> str:
    """`/specdec.v1.TargetService/Verify` -> `specdec.v1.TargetService/Verify` (the span name)."""
    text = method.decode() if isinstance(method, bytes) else method
    return text.lstrip("/")


def _rpc_attributes(name: str) -> dict[str, str]:
    service, _, method = name.rpartition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


# what grpc says of a call its own caller cancelled (`call.cancel()`)
LOCAL_CANCEL = "Locally cancelled by application!"


def _finish(span: trace.Span, code: grpc.StatusCode, details: str | None = None, by_caller: bool = False) -> None:
    """End a span with the call's status: ERROR unless OK, or unless the call's own caller cancelled it
    (`by_caller`: a client span of a call its caller stopped, because its client left or its deadline passed, is
    not a failure of its own; the caller's span says why. Before, the gateway's call to the draft showed an ERROR
    "CANCELLED: Locally cancelled by application!" under every cancelled or timed-out request, QA)."""
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if by_caller:
        span.set_attribute("specdec.cancelled_by_caller", True)
    elif code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}".rstrip(": ")))
    span.end()


class _ClientTracing:
    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def _start(
        self, details: grpc.aio.ClientCallDetails
    ) -> tuple[trace.Span | None, grpc.aio.ClientCallDetails]:
        current = trace.get_current_span()
        if not current.get_span_context().is_valid:  # outside any trace: no root span per RPC
            return None, details
        if not current.is_recording():  # sampled out upstream: pass the decision on, record nothing
            return None, _inject(details, otel_context.get_current())
        name = _method_name(details.method)
        span = self._tracer.start_span(name, kind=SpanKind.CLIENT, attributes=_rpc_attributes(name))
        return span, _inject(details, trace.set_span_in_context(span))


def _inject(details: grpc.aio.ClientCallDetails, ctx: otel_context.Context) -> grpc.aio.ClientCallDetails:
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=ctx)
    kept = [(k, v) for k, v in (details.metadata or ()) if k not in _PROPAGATED_KEYS]
    return details._replace(metadata=grpc.aio.Metadata(*kept, *carrier.items()))


class UnaryUnaryTracing(_ClientTracing, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        span, details = self._start(client_call_details)
        if span is None:
            return await continuation(details, request)
        try:
            call = await continuation(details, request)
            code = await call.code()  # the RPC's end; the caller's `await call` then returns at once
        except asyncio.CancelledError:
            _finish(span, grpc.StatusCode.CANCELLED, by_caller=True)
            raise
        _finish(span, code, await call.details())
        return call


class UnaryStreamTracing(_ClientTracing, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        span, details = self._start(client_call_details)
        call = await continuation(details, request)
        if span is not None:  # the stream outlives this method: end the span when the RPC ends

            def on_done(done_call: grpc.aio.Call) -> None:
                task = asyncio.ensure_future(_finish_stream(span, done_call))
                _FINISHING.add(task)  # hold a reference until it has run
                task.add_done_callback(_FINISHING.discard)

            call.add_done_callback(on_done)
        return call


_FINISHING: set[asyncio.Future] = set()


@contextlib.contextmanager
def blocking_call_metadata(
    method: str | bytes, metadata: Collection[tuple[str, str]] = (), tracer: trace.Tracer | None = None
) -> Iterator[list[tuple[str, str]]]:
    """For a blocking (non-aio) call, where the interceptors above do not apply: yields the call's metadata
    with `traceparent` added, under the same rules (outside any trace: nothing added, no span; under a
    sampled-out span: the flag passed on, no span; else a CLIENT span named after `method`, ended with the
    call's status when the block exits).

        with blocking_call_metadata("/specdec.v1.TargetService/Verify") as metadata:
            reply = stub.Verify(request, metadata=metadata)
    """
    current = trace.get_current_span()
    if not current.get_span_context().is_valid:
        yield list(metadata)
        return
    if not current.is_recording():
        yield _with_context(metadata, otel_context.get_current())
        return
    name = _method_name(method)
    span = (tracer or get_tracer()).start_span(name, kind=SpanKind.CLIENT, attributes=_rpc_attributes(name))
    try:
        yield _with_context(metadata, trace.set_span_in_context(span))
    except grpc.RpcError as exc:
        code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
        _finish(span, code, exc.details() if hasattr(exc, "details") else str(exc))
        raise
    except grpc.FutureCancelledError:  # the caller cancelled the call (a draft's Prefill whose client left)
        _finish(span, grpc.StatusCode.CANCELLED, by_caller=True)
        raise
    except BaseException as exc:
        span.record_exception(exc)
        _finish(span, grpc.StatusCode.UNKNOWN, str(exc))
        raise
    _finish(span, grpc.StatusCode.OK)


def _with_context(metadata: Collection[tuple[str, str]], ctx: otel_context.Context) -> list[tuple[str, str]]:
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=ctx)
    return [*((k, v) for k, v in metadata if k not in _PROPAGATED_KEYS), *carrier.items()]


async def _finish_stream(span: trace.Span, call: grpc.aio.Call) -> None:
    code, details = await call.code(), await call.details()
    _finish(span, code, details, by_caller=call.cancelled() and details == LOCAL_CANCEL)


# ---------------------------------------------------------------------------------------------- server side


@contextlib.contextmanager
def server_span(
    context: grpc.aio.ServicerContext,
    method: str,
    request: Any = None,
    *,
    tracer: trace.Tracer | None = None,
    parent_required: bool = False,
    current: bool = True,
) -> Iterator[trace.Span | None]:
    """Run the body inside a SERVER span for RPC `method`, child of the caller's context (see module doc).

    Yields the span, or None when `parent_required` and the caller sent no trace context. `current=False` leaves
    the span out of the context (a stream makes it current around each step itself: `_in_span`).
    """
    metadata = dict(context.invocation_metadata() or ())
    parent = PROPAGATOR.extract(metadata)
    if parent_required and not trace.get_current_span(parent).get_span_context().is_valid:
        yield None
        return
    name = _method_name(method)
    attributes = _rpc_attributes(name)
    request_id = _request_id(request) or request_id_from(context)  # as the services read it
    if isinstance(request_id, str) and request_id:
        attributes["specdec.request_id"] = loggable_id(request_id)  # a client's, not yet checked
    tracer = tracer or get_tracer()
    span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
    made_current = trace.use_span(span, record_exception=False, set_status_on_exception=False) if current else \
        contextlib.nullcontext()
    with made_current:
        try:
            yield span
        except (asyncio.CancelledError, GeneratorExit):  # the client left (GeneratorExit: a closed stream)
            _finish(span, left_status(context))  # or its deadline passed
            raise
        except Exception as exc:
            code = context.code()  # set by context.abort(); None for an unexpected exception
            if code is None or code is grpc.StatusCode.OK:
                span.record_exception(exc)
                code = grpc.StatusCode.UNKNOWN
            _finish(span, code, context.details() or str(exc))
            raise
        _finish(span, context.code() or grpc.StatusCode.OK, context.details())


async def _in_span(span: trace.Span | None, step: Awaitable[Any]) -> Any:
    """`step` (one response of a stream) awaited with `span` current. The span is made current per step, never
    across a stream's `yield`: grpc may close a cancelled stream's generator from another task (asyncio's
    async-generator finalizer), where detaching a context attached in the first one fails (OpenTelemetry logs an
    ERROR with a traceback for what is a normal cancel)."""
    if span is None:
        return await step
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        return await step
    finally:
        otel_context.detach(token)  # the same task as the attach: an await resumes in its own task


def _request_id(request: Any) -> str | None:
    try:
        value = getattr(request, "request_id", None)
    except Exception:  # an exotic message type; the id is only an attribute
        return None
    return value if isinstance(value, str) and value else None


class TracingServerInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every method handler in `server_span` (unary and streaming, request and response)."""

    def __init__(self, tracer: trace.Tracer, parent_required: Collection[str] = ()) -> None:
        self._tracer = tracer
        self._parent_required = frozenset(parent_required)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        span_args = {"tracer": self._tracer, "parent_required": method in self._parent_required}
        for kind, factory in _HANDLER_FACTORIES.items():
            behavior = getattr(handler, kind)
            if behavior is not None:
                wrapped = _wrap(behavior, method, span_args, unary_request=kind.startswith("unary_"))
                return factory(
                    wrapped,
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler


_HANDLER_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _wrap(behavior, method: str, span_args: dict[str, Any], unary_request: bool):
    """`behavior` (a coroutine or async-generator function) run inside `server_span`; same kind."""
    if inspect.isasyncgenfunction(behavior):

        async def stream_behavior(request_or_iterator, context):
            request = request_or_iterator if unary_request else None
            # a closed stream closes the service's generator now, not when it is collected, and with the span
            # current: a stream the client cancelled is closed from outside its steps, and the service's `finally`
            # (the draft's "ended early" line) logged without the trace id (QA: 1-3 of 20 cancelled streams)
            with server_span(context, method, request, current=False, **span_args) as span:
                responses = behavior(request_or_iterator, context)
                try:
                    while True:
                        try:
                            response = await _in_span(span, anext(responses))
                        except StopAsyncIteration:
                            return
                        yield response
                finally:
                    await _in_span(span, responses.aclose())

        return stream_behavior

    async def unary_behavior(request_or_iterator, context):
        request = request_or_iterator if unary_request else None
        with server_span(context, method, request, **span_args):
            result = behavior(request_or_iterator, context)
            return await result if inspect.isawaitable(result) else result

    return unary_behavior
