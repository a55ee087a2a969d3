"""Tracing off costs nothing; step spans are sampled per step; samplers follow OTEL_TRACES_SAMPLER."""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import DEFAULT_ON, ParentBasedTraceIdRatio, TraceIdRatioBased

from specdec.telemetry import StepSpanSampler, TelemetryConfig, setup_tracing, shutdown_tracing
from specdec.telemetry.tracing import active_provider, build_sampler


def recording_tracer() -> tuple[trace.Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_no_endpoint_means_no_provider():
    assert setup_tracing("svc", TelemetryConfig()) is None
    disabled = TelemetryConfig(traces_endpoint="http://127.0.0.1:1", sdk_disabled=True)
    assert setup_tracing("svc", disabled) is None
    assert active_provider() is None
    shutdown_tracing()  # a no-op when off


def test_step_spans_cost_nothing_when_tracing_is_off():
    steps = StepSpanSampler(ratio=1.0)  # no provider installed: never samples, whatever the ratio
    start = time.perf_counter()
    for _ in range(100_000):
        sampled = steps.sample_step()
        with steps.span("draft.propose", sampled, batch_size=8, num_draft_tokens=32):
            pass
    elapsed_s = time.perf_counter() - start
    assert elapsed_s < 0.5, f"100k off step spans took {elapsed_s * 1e3:.0f} ms"


def test_ratio_zero_records_nothing_and_one_records_every_step():
    tracer, exporter = recording_tracer()
    never, always = StepSpanSampler(0.0, tracer), StepSpanSampler(1.0, tracer)
    for steps in (never, always):
        for _ in range(5):
            sampled = steps.sample_step()
            with steps.span("draft.verify", sampled, batch_size=4, num_draft_tokens=16) as span:
                if span is not None:
                    span.set_attribute("accepted", 7)
    spans = exporter.get_finished_spans()
    assert len(spans) == 5
    assert dict(spans[0].attributes) == {"batch_size": 4, "num_draft_tokens": 16, "accepted": 7}


def test_fractional_ratio_decides_once_per_step():
    tracer, exporter = recording_tracer()
    draws = iter([0.05, 0.5, 0.2, 0.9])
    steps = StepSpanSampler(0.25, tracer, random_fn=lambda: next(draws))
    decisions = []
    for _ in range(4):
        sampled = steps.sample_step()
        decisions.append(sampled)
        for name in ("draft.propose", "draft.verify", "draft.extend"):
            with steps.span(name, sampled):
                pass
    assert decisions == [True, False, True, False]
    assert len(exporter.get_finished_spans()) == 6


def test_build_sampler_names():
    def sampler(name: str, arg: float = 1.0):
        return build_sampler(TelemetryConfig(traces_sampler=name, traces_sampler_arg=arg))

    assert sampler("parentbased_always_on") is DEFAULT_ON
    assert sampler("no_such_sampler") is DEFAULT_ON
    assert (
        isinstance(sampler("traceidratio", 0.5), TraceIdRatioBased)
        and sampler("traceidratio", 0.5).rate == 0.5
    )
    assert isinstance(sampler("parentbased_traceidratio", 0.1), ParentBasedTraceIdRatio)


def test_the_start_up_line_names_the_sampler_in_use():
    """An unknown name falls back, and the line said the unknown name (QA); a ratio sampler's ratio is said too."""
    from specdec.telemetry.tracing import sampler_label

    label = lambda name, arg=1.0: sampler_label(TelemetryConfig(traces_sampler=name, traces_sampler_arg=arg))  # noqa: E731
    assert label("bogus") == "parentbased_always_on" and label("always_off") == "always_off"
    assert label("parentbased_traceidratio", 0.25) == "parentbased_traceidratio(0.25)"


def test_shutdown_gives_up_on_an_unreachable_collector(monkeypatch):
    """With the collector down, a service's exit waited for the exporter's retries (7-13 s in QA, a 5 s flush
    included): now it stops the exporter once its flush time is up."""
    import socket

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from specdec.telemetry import tracing

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}", insecure=True)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_provider", provider)
    monkeypatch.setattr(tracing, "_exporter", exporter)
    with provider.get_tracer("probe").start_as_current_span("queued"):
        pass
    t0 = time.monotonic()
    shutdown_tracing(timeout_s=1.0)
    assert time.monotonic() - t0 < 3.0
    assert active_provider() is None
