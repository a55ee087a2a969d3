"""Trace context over grpc.aio in one process: caller and server providers with in-memory exporters."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode

from specdec.telemetry.grpc_tracing import client_interceptors, server_interceptors

SERVICE = "specdec.test.Echo"
identity = {"request_deserializer": None, "response_serializer": None}


def make_provider(sampler=None) -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


class EchoService:
    def __init__(self) -> None:
        self.metadata_seen: list[dict] = []

    async def echo(self, request: bytes, context) -> bytes:
        self.metadata_seen.append(dict(context.invocation_metadata()))
        return request

    async def fail(self, request: bytes, context) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, "no such request")

    async def count(self, request: bytes, context):
        for i in range(3):
            yield bytes([i])

    async def forever(self, request: bytes, context):
        while True:
            yield b"x"
            await asyncio.sleep(0.01)

    def handler(self) -> grpc.GenericRpcHandler:
        unary, stream = grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {"Echo": unary(self.echo), "Fail": unary(self.fail), "Count": stream(self.count),
             "Forever": stream(self.forever)},
        )  # fmt: skip


@contextlib.asynccontextmanager
async def echo_pair(client_provider, server_provider, parent_required=()):
    """An aio server with the tracing interceptors and a channel to it; yields (channel, service)."""
    service = EchoService()
    server = grpc.aio.server(interceptors=server_interceptors(server_provider, parent_required))
    server.add_generic_rpc_handlers((service.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        interceptors = client_interceptors(client_provider)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=interceptors) as channel:
            yield channel, service
    finally:
        await server.stop(grace=None)


def wait_for_spans(exporter: InMemorySpanExporter, count: int, timeout_s: float = 3.0) -> list:
    deadline = time.monotonic() + timeout_s
    while len(exporter.get_finished_spans()) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(exporter.get_finished_spans())


def test_interceptors_are_absent_when_tracing_is_off():
    assert client_interceptors() == []
    assert server_interceptors() == []


def test_unary_call_links_client_and_server_spans_and_keeps_metadata():
    (client_tp, client_spans), (server_tp, server_spans) = make_provider(), make_provider()

    async def run():
        async with echo_pair(client_tp, server_tp) as (channel, service):
            with client_tp.get_tracer("t").start_as_current_span("caller") as caller:
                metadata = (("x-request-id", "r1"),)
                reply = await channel.unary_unary(f"/{SERVICE}/Echo")(b"hi", metadata=metadata)
            return reply, caller, service.metadata_seen

    reply, caller, seen = asyncio.run(run())
    assert reply == b"hi"
    assert seen[0]["x-request-id"] == "r1" and seen[0]["traceparent"].startswith("00-")
    (server,) = wait_for_spans(server_spans, 1)
    client = next(s for s in client_spans.get_finished_spans() if s.kind is SpanKind.CLIENT)
    assert client.name == server.name == f"{SERVICE}/Echo"
    assert client.parent.span_id == caller.get_span_context().span_id
    assert server.kind is SpanKind.SERVER and server.parent.span_id == client.context.span_id
    assert server.parent.is_remote and server.context.trace_id == caller.get_span_context().trace_id
    assert server.attributes["specdec.request_id"] == "r1"
    assert server.attributes["rpc.method"] == "Echo" and server.attributes["rpc.grpc.status_code"] == 0


def test_a_request_id_sent_twice_is_its_first_value_on_the_span_as_in_the_services():
    (client_tp, _), (server_tp, server_spans) = make_provider(), make_provider()

    async def run():
        async with echo_pair(client_tp, server_tp) as (channel, _):
            metadata = (("x-request-id", "a"), ("x-request-id", "b"))
            await channel.unary_unary(f"/{SERVICE}/Echo")(b"hi", metadata=metadata)

    asyncio.run(run())
    (server,) = wait_for_spans(server_spans, 1)
    assert server.attributes["specdec.request_id"] == "a"  # `request_id_from`'s pick (QA: the span said "b")


def test_abort_marks_both_spans_with_the_status():
    (client_tp, client_spans), (server_tp, server_spans) = make_provider(), make_provider()

    async def run():
        async with echo_pair(client_tp, server_tp) as (channel, _):
            caller = client_tp.get_tracer("t").start_as_current_span("caller")
            with caller, pytest.raises(grpc.aio.AioRpcError) as err:
                await channel.unary_unary(f"/{SERVICE}/Fail")(b"")
        assert err.value.code() is grpc.StatusCode.NOT_FOUND

    asyncio.run(run())
    (server,) = wait_for_spans(server_spans, 1)
    client = next(s for s in client_spans.get_finished_spans() if s.kind is SpanKind.CLIENT)
    for span in (client, server):
        assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]
        assert span.status.status_code is StatusCode.ERROR
        assert span.status.description == "NOT_FOUND: no such request"


def test_stream_spans_cover_the_stream_and_end_on_cancel():
    (client_tp, client_spans), (server_tp, server_spans) = make_provider(), make_provider()

    async def run():
        async with echo_pair(client_tp, server_tp) as (channel, _):
            with client_tp.get_tracer("t").start_as_current_span("caller"):
                items = [item async for item in channel.unary_stream(f"/{SERVICE}/Count")(b"")]
                call = channel.unary_stream(f"/{SERVICE}/Forever")(b"")
                assert await call.read() == b"x"
                call.cancel()
            await asyncio.sleep(0.2)  # let the done callback and the server see the cancellation
        return items

    assert asyncio.run(run()) == [b"\x00", b"\x01", b"\x02"]
    servers = {s.name: s for s in wait_for_spans(server_spans, 2)}
    clients = {s.name: s for s in client_spans.get_finished_spans() if s.kind is SpanKind.CLIENT}
    assert set(servers) == set(clients) == {f"{SERVICE}/Count", f"{SERVICE}/Forever"}
    for spans in (servers, clients):
        assert spans[f"{SERVICE}/Count"].attributes["rpc.grpc.status_code"] == 0
        cancelled = spans[f"{SERVICE}/Forever"]
        assert cancelled.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    # the server's span records its client leaving as an error; the client's own cancel is no failure of the
    # client span (QA: every cancelled or timed-out gateway request showed a red downstream span)
    assert servers[f"{SERVICE}/Forever"].status.status_code is StatusCode.ERROR
    assert clients[f"{SERVICE}/Forever"].status.status_code is StatusCode.UNSET
    assert clients[f"{SERVICE}/Forever"].attributes["specdec.cancelled_by_caller"] is True
    assert servers[f"{SERVICE}/Count"].parent.span_id == clients[f"{SERVICE}/Count"].context.span_id


def test_calls_outside_a_trace_make_no_client_span_and_parent_required_methods_no_server_span():
    (client_tp, client_spans), (server_tp, server_spans) = make_provider(), make_provider()
    echo = f"/{SERVICE}/Echo"

    async def run():
        async with echo_pair(client_tp, server_tp, parent_required={echo}) as (channel, service):
            await channel.unary_unary(echo)(b"")  # no current span: nothing sent, nothing recorded
            async for _ in channel.unary_stream(f"/{SERVICE}/Count")(b""):
                pass
            return service.metadata_seen

    seen = asyncio.run(run())
    assert "traceparent" not in seen[0]
    assert client_spans.get_finished_spans() == ()
    (server,) = wait_for_spans(server_spans, 1)  # Count is not parent-required: a root span
    assert server.name == f"{SERVICE}/Count" and server.parent is None


def test_sampled_out_caller_propagates_the_decision():
    (client_tp, client_spans), (server_tp, server_spans) = make_provider(ALWAYS_OFF), make_provider()

    async def run():
        async with echo_pair(client_tp, server_tp) as (channel, service):
            with client_tp.get_tracer("t").start_as_current_span("caller"):
                await channel.unary_unary(f"/{SERVICE}/Echo")(b"")
            return service.metadata_seen

    (seen,) = asyncio.run(run())
    assert int(seen["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0  # a valid context, sampled flag off
    time.sleep(0.1)
    assert client_spans.get_finished_spans() == () and server_spans.get_finished_spans() == ()


class _StreamContext:
    """The parts of a grpc.aio.ServicerContext that `server_span` reads, for driving a wrapped behavior directly."""

    def invocation_metadata(self):
        return ()

    def code(self):
        return None

    def details(self):
        return None

    def time_remaining(self):
        return None


def test_a_stream_closed_from_another_context_ends_its_span_without_a_detach_error_and_closes_in_it(caplog):
    """grpc may close a cancelled stream's generator from another task (asyncio's async-generator finalizer runs
    `aclose` in a new one): nothing of the server span may be attached to the context across a `yield`, or
    OpenTelemetry logs 'Failed to detach context' as an ERROR with a traceback for a normal cancel."""
    from opentelemetry import trace

    from specdec.telemetry.grpc_tracing import _wrap

    provider, exporter = make_provider()
    tracer = provider.get_tracer("t")
    seen: dict[str, object] = {}

    async def behavior(request, context):
        try:
            for i in range(100):
                seen.setdefault("current", trace.get_current_span())
                with tracer.start_as_current_span("child"):
                    await asyncio.sleep(0)
                yield bytes([i])
        finally:
            seen["closed"] = True
            seen["at_close"] = trace.get_current_span()  # the draft's "ended early" line logs here

    async def run():
        stream = _wrap(behavior, f"/{SERVICE}/Forever", {"tracer": tracer}, unary_request=True)(b"", _StreamContext())
        assert await asyncio.create_task(anext(stream)) == b"\x00"  # iterated in one task's context ...
        await asyncio.create_task(stream.aclose(), context=contextvars.Context())  # ... closed in another's

    with caplog.at_level(logging.ERROR):
        asyncio.run(run())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert seen["closed"] is True  # the service's generator is closed with the stream, not left to the collector
    spans = {s.name: s for s in exporter.get_finished_spans()}
    server, child = spans[f"{SERVICE}/Forever"], spans["child"]
    assert seen["current"] is not None and seen["current"].get_span_context() == server.get_span_context()
    # closed from outside its steps, the service's `finally` still runs in the call's span (QA: the draft's "ended
    # early" line of 1-3 of 20 cancelled streams had no trace id)
    assert seen["at_close"].get_span_context() == server.get_span_context()
    assert child.parent.span_id == server.context.span_id  # the service's spans are the server span's children
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]


def test_health_probes_make_no_trace_unless_the_caller_sends_one():
    """Check and List (and Watch) polled by a probe or a mesh make no root trace (QA: List made one per call); under a
    caller's trace they are spans of it."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specdec.rpc.health_list import HealthServicer

    (client_tp, _), (server_tp, server_spans) = make_provider(), make_provider()

    async def run():
        server = grpc.aio.server(interceptors=server_interceptors(server_tp))
        servicer = HealthServicer()
        await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                                 interceptors=client_interceptors(client_tp)) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                await stub.Check(health_pb2.HealthCheckRequest())
                listed = await stub.List(health_pb2.HealthListRequest())
                with client_tp.get_tracer("t").start_as_current_span("caller"):
                    await stub.List(health_pb2.HealthListRequest())
                return listed
        finally:
            await server.stop(grace=None)

    listed = asyncio.run(run())
    assert listed.statuses[""].status == health_pb2.HealthCheckResponse.SERVING
    (server,) = wait_for_spans(server_spans, 1)
    time.sleep(0.1)
    assert len(server_spans.get_finished_spans()) == 1  # only the call made under the caller's span
    assert server.name == "grpc.health.v1.Health/List" and server.parent is not None
