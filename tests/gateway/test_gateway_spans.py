"""The gateway's own spans over fake pairs, recorded in memory: a failure marks only the span it happened in."""

from __future__ import annotations

import pytest
from gateway_fakes import fake_stack, run, status_of
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from gateway.config import GatewayLimits
from specdec.telemetry import tracing
from specdec.v1 import common_pb2, gateway_pb2

GENERATE_SPAN = "specdec.v1.GatewayService/Generate"


@pytest.fixture
def spans(monkeypatch) -> InMemorySpanExporter:
    """Tracing on in this process, as `setup_tracing` leaves it (the server interceptors read `_provider`, the
    gateway's own spans the global provider), into memory; both restored after (the API sets its global once)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_provider", provider)
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    return exporter



def traces(finished) -> list[list]:
    """The spans of each Generate's trace, in the order the requests finished."""
    roots = [s for s in finished if s.name == GENERATE_SPAN]
    return [[s for s in finished if s.context.trace_id == root.context.trace_id] for root in roots]


@pytest.mark.parametrize("prompt, sampling, message", [
    ("def fib(n):", dict(temperature=-1.0), "temperature must be in [0, 100]"),
    ("def fib(n):", dict(top_p=1.5), "top_p must be in (0, 1]"),
    ("word " * 40, {}, "tokens; the limit is 32"),  # tokenized, then refused
])  # fmt: skip
def test_a_refused_request_marks_its_server_span_not_the_tokenize_span(fake_model, model_dir, spans, prompt,
                                                                        sampling, message):
    async def body():
        async with fake_stack(fake_model, model_dir, limits=GatewayLimits(max_prompt_tokens=32)) as (_, _, stub):
            refused = await status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                prompt=prompt, sampling=common_pb2.SamplingParams(**sampling))))
            served = await status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(prompt="def fib(n):")))
            return refused, served

    (code, details), served = run(body())
    assert code == "INVALID_ARGUMENT" and message in details and served == ("OK", "")
    refused_trace, served_trace = traces(spans.get_finished_spans())
    errors = [(s.name, s.status.description) for s in refused_trace if s.status.status_code is StatusCode.ERROR]
    assert errors == [(GENERATE_SPAN, f"INVALID_ARGUMENT: {details}")]
    # the tokenize span still covers a served request's tokenizing, under its server span
    (tokenize,) = [s for s in served_trace if s.name == "gateway.tokenize"]
    (server,) = [s for s in served_trace if s.name == GENERATE_SPAN]
    assert tokenize.parent.span_id == server.context.span_id and tokenize.attributes["num_prompt_tokens"] > 0
    assert all(s.status.status_code is not StatusCode.ERROR for s in served_trace)


def test_a_cancelled_streams_access_line_carries_its_trace(fake_model, model_dir, spans, caplog):
    """The access log's line of a stream the client cancelled mid-way names the call's trace, as a finished one's
    does (QA: 3 of 9 cancelled streams' lines had no trace id: the stream is closed from outside its context)."""
    import asyncio
    import logging

    from specdec.telemetry.logs import ContextFilter

    N = 24

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            pairs[0].draft.delay_s = 0.01
            for i in range(N):
                call = stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                    prompt="def fib(n):", request_id=f"cut{i}", sampling=common_pb2.SamplingParams(max_new_tokens=100)))
                for _ in range(i % 3):  # cancelled before its first message, after one, after two
                    await call.read()
                await asyncio.sleep(0.003 * (i % 4))
                call.cancel()
            await asyncio.sleep(0.3)

    handler_filter = ContextFilter()
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        caplog.handler.addFilter(handler_filter)
        try:
            run(body())
        finally:
            caplog.handler.removeFilter(handler_filter)
    lines = [r for r in caplog.records if r.name == "gateway.access" and "Generate" in r.getMessage()]
    # (a call cancelled before its first message may not have reached the gateway at all: no line)
    assert len(lines) >= N // 2 and all(r.grpc_status == "CANCELLED" for r in lines)
    roots = {format(s.context.trace_id, "032x") for s in spans.get_finished_spans() if s.name == GENERATE_SPAN}
    assert {r.trace_id for r in lines} <= roots and all(r.trace_id for r in lines), [r.trace_id for r in lines]


def test_a_fallback_is_an_event_on_the_requests_server_span(fake_model, model_dir, spans):
    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            pairs[0].draft.fail_after_chunks = 2
            return await status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                prompt="def fib(n):", sampling=common_pb2.SamplingParams(max_new_tokens=100))))

    assert run(body()) == ("OK", "")
    ((server,),) = [[s for s in t if s.name == GENERATE_SPAN] for t in traces(spans.get_finished_spans())]
    (event,) = [e for e in server.events if e.name == "specdec.fallback"]
    assert event.attributes["specdec.failed_part"] == "draft"
    assert event.attributes["specdec.pair"].startswith("pair 0")
    assert event.attributes["specdec.reason"] == "UNAVAILABLE: fake service went away"


def test_a_wait_for_a_pair_is_an_event_in_the_requests_trace(fake_model, model_dir, spans):
    """A request that arrives while no pair is up waits for one (`--pair-wait-seconds`): its trace says how long, on
    the route span, and which pair it then took."""
    import asyncio

    from grpc_health.v1 import health_pb2

    async def body():
        async with fake_stack(fake_model, model_dir, pair_wait_s=10) as (pairs, gateway, stub):
            await pairs[0].target_handle.set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
            while gateway.router.pairs[0].target_up:
                await asyncio.sleep(0.02)
            call = status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                prompt="def fib(n):", sampling=common_pb2.SamplingParams(max_new_tokens=10))))
            waiting = asyncio.ensure_future(call)
            await asyncio.sleep(0.3)
            await pairs[0].target_handle.set_serving(True)
            return await waiting

    assert run(body()) == ("OK", "")
    (trace_spans,) = traces(spans.get_finished_spans())
    (route,) = [s for s in trace_spans if s.name == "gateway.route"]
    (event,) = [e for e in route.events if e.name == "specdec.waited_for_pair"]
    assert 0.3 <= event.attributes["specdec.wait_s"] < 3 and event.attributes["specdec.pair"].startswith("pair 0")
