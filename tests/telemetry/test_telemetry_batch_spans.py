"""Spans over a batch (`batch_parent`, `attached`, `current_trace_context`) and the blocking client's trace
context (`blocking_call_metadata`), on a private TracerProvider with an in-memory exporter."""

from __future__ import annotations

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, StatusCode, TraceFlags

from specdec.telemetry.grpc_tracing import blocking_call_metadata
from specdec.telemetry.tracing import StepSpanSampler, attached, batch_parent, current_trace_context

METHOD = "/specdec.v1.TargetService/Verify"


@pytest.fixture
def tracing():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def _sampled_out_context():
    span_context = SpanContext(0x1234, 0x99, is_remote=True, trace_flags=TraceFlags(0))
    return trace.set_span_in_context(NonRecordingSpan(span_context))


def test_telemetry_batch_parent_first_sampled_request_other_sampled_ones_linked(tracing):
    tracer, exporter = tracing
    with tracer.start_as_current_span("req-a") as a:
        ctx_a = current_trace_context()
    with tracer.start_as_current_span("req-b") as b:
        ctx_b = current_trace_context()
    parent, links = batch_parent([None, _sampled_out_context(), ctx_a, ctx_b])
    assert trace.get_current_span(parent) is a
    # no link to the request its caller did not trace: that trace is never exported (QA saw Jaeger's "missing
    # trace" references, and a sampled-out caller's trace id inside another caller's trace)
    assert [link.context.span_id for link in links] == [b.get_span_context().span_id]

    sampler = StepSpanSampler(1.0, tracer)
    with sampler.span("draft.verify", sampler.sample_step(), links, parent, batch_size=3):
        pass
    (step,) = [s for s in exporter.get_finished_spans() if s.name == "draft.verify"]
    assert step.parent.span_id == a.get_span_context().span_id
    assert step.context.trace_id == a.get_span_context().trace_id
    assert len(step.links) == 1 and step.attributes["batch_size"] == 3


def test_telemetry_batch_parent_without_sampled_request():
    assert batch_parent([None, _sampled_out_context()])[0] is None
    assert batch_parent([]) == (None, [])
    assert current_trace_context() is None  # no span current: nothing to carry


def test_telemetry_attached_makes_a_context_current(tracing):
    tracer, _ = tracing
    with tracer.start_as_current_span("req") as span:
        ctx = current_trace_context()
    assert not trace.get_current_span().get_span_context().is_valid
    with attached(ctx):
        assert trace.get_current_span() is span
    with attached(None):
        assert not trace.get_current_span().get_span_context().is_valid


def test_telemetry_blocking_call_outside_a_trace_sends_nothing(tracing):
    tracer, exporter = tracing
    with blocking_call_metadata(METHOD, [("x-request-id", "r1")], tracer) as metadata:
        pass
    assert metadata == [("x-request-id", "r1")]
    assert exporter.get_finished_spans() == ()


def test_telemetry_blocking_call_gets_a_client_span(tracing):
    tracer, exporter = tracing
    with tracer.start_as_current_span("draft.verify") as step, blocking_call_metadata(METHOD, (), tracer) as metadata:
        pass
    (client,) = [s for s in exporter.get_finished_spans() if s.kind is trace.SpanKind.CLIENT]
    assert client.name == "specdec.v1.TargetService/Verify"
    assert client.parent.span_id == step.get_span_context().span_id
    assert client.attributes["rpc.grpc.status_code"] == 0
    (traceparent,) = [v for k, v in metadata if k == "traceparent"]
    assert traceparent.startswith(f"00-{client.context.trace_id:032x}-{client.context.span_id:016x}-")
    assert int(traceparent[-2:], 16) & 1  # sampled


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "target gone"


def test_telemetry_blocking_call_error_sets_status(tracing):
    tracer, exporter = tracing
    with (
        tracer.start_as_current_span("draft.verify"),
        pytest.raises(_Unavailable),
        blocking_call_metadata(METHOD, (), tracer),
    ):
        raise _Unavailable()
    (client,) = [s for s in exporter.get_finished_spans() if s.kind is trace.SpanKind.CLIENT]
    assert client.status.status_code is trace.StatusCode.ERROR
    assert client.status.description == "UNAVAILABLE: target gone"
    assert client.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]


def test_telemetry_blocking_call_under_sampled_out_span_passes_the_flag(tracing):
    tracer, exporter = tracing
    with attached(_sampled_out_context()), blocking_call_metadata(METHOD, (), tracer) as metadata:
        pass
    (traceparent,) = [v for k, v in metadata if k == "traceparent"]
    assert traceparent.endswith("-00")
    assert exporter.get_finished_spans() == ()


def test_telemetry_a_call_its_caller_cancelled_is_cancelled_without_an_exception_event(tracing):
    """A draft's Prefill cancelled because its client left (`TargetClient.cancel_prefill`): CANCELLED, as the
    target's server span says, not UNKNOWN with a traceback (QA)."""
    tracer, exporter = tracing
    with (
        tracer.start_as_current_span("req"),
        pytest.raises(grpc.FutureCancelledError),
        blocking_call_metadata(METHOD, (), tracer),
    ):
        raise grpc.FutureCancelledError()
    (client,) = [s for s in exporter.get_finished_spans() if s.kind is trace.SpanKind.CLIENT]
    assert client.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    # not a failure of its own (the caller's span says why): no ERROR status, no exception event
    assert client.status.status_code is StatusCode.UNSET and not client.events
    assert client.attributes["specdec.cancelled_by_caller"] is True
