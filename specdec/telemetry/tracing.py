"""OpenTelemetry tracing: set up from the environment, off (and free) when no collector is configured.

    provider = setup_tracing("target_service")   # None: tracing off, every tracer is the no-op one
    ...
    shutdown_tracing()                             # flushes queued spans; call once at exit

Spans leave through the OTLP/gRPC exporter behind a `BatchSpanProcessor` (export happens on a background
thread, never on the event loop). Per-step spans of the speculative loop have their own, cheaper knob: see
`StepSpanSampler`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlparse

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace import sampling as sdk_sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from specdec.telemetry.config import TelemetryConfig

logger = logging.getLogger(__name__)

TRACER_NAME = "specdec"

_provider: TracerProvider | None = None
_exporter = None  # the OTLP exporter behind `_provider` (`shutdown_tracing` stops it first when the collector lags)


def setup_tracing(service_name_default: str, config: TelemetryConfig | None = None) -> TracerProvider | None:
    """Install the global tracer provider when an OTLP endpoint is set; return it (None: tracing is off).

    `OTEL_SERVICE_NAME` overrides `service_name_default`. Calling it again returns the provider already set.
    """
    global _provider
    config = config or TelemetryConfig.from_env()
    if _provider is not None:
        return _provider
    if not config.tracing_enabled:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # only when on

    resource = Resource.create({SERVICE_NAME: config.service_name or service_name_default})
    provider = TracerProvider(resource=resource, sampler=build_sampler(config))
    global _exporter
    _exporter = OTLPSpanExporter(endpoint=config.traces_endpoint)
    provider.add_span_processor(BatchSpanProcessor(_exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    transport = otlp_transport(config.traces_endpoint)
    logger.info(
        "tracing on: service=%s endpoint=%s (%s) sampler=%s",
        resource.attributes[SERVICE_NAME],
        config.traces_endpoint,
        transport,
        sampler_label(config),
    )
    if transport == "TLS" and "://" not in config.traces_endpoint:
        logger.warning("the OTLP endpoint %s has no scheme, so spans go over TLS (OpenTelemetry's rule; "
                       "OTEL_EXPORTER_OTLP_INSECURE=true says otherwise): write http://%s for a collector without "
                       "TLS, or no span arrives", config.traces_endpoint, config.traces_endpoint)
    return provider


def otlp_transport(endpoint: str, environ=None) -> str:
    """"TLS" or "plaintext": what the OTLP gRPC span exporter uses for `endpoint`, by its own rule: https:// is
    TLS; else OTEL_EXPORTER_OTLP_TRACES_INSECURE, then OTEL_EXPORTER_OTLP_INSECURE, when set ("true":
    plaintext); else http:// is plaintext and anything else (no scheme) TLS. A scheme-less endpoint lost every span
    to a plaintext collector with only SSL errors to say why (QA)."""
    env = os.environ if environ is None else environ
    scheme = urlparse(endpoint).scheme.lower() if "://" in endpoint else ""
    if scheme == "https":
        return "TLS"
    for name in ("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "OTEL_EXPORTER_OTLP_INSECURE"):
        if env.get(name) is not None:
            return "plaintext" if env[name].strip().lower() == "true" else "TLS"
    return "plaintext" if scheme == "http" else "TLS"


def shutdown_tracing(timeout_s: float = 5.0) -> None:
    """Export the spans still queued (up to `timeout_s`) and stop the exporter; a no-op when tracing is off. A
    collector that has not taken them by then (down, unreachable) is given up on: the exporter stops, which ends
    its retries (a service's exit took 7-13 s with the collector down, most of a pod's grace period after its
    drain: QA)."""
    global _provider, _exporter
    if _provider is None:
        return
    # the flush's own timeout does not bound an export under way: the exporter retries an unreachable collector
    # for its whole timeout (7.7 s for a 1 s flush); stopping the exporter ends its retries
    stop = threading.Timer(timeout_s, _give_up, (_exporter, timeout_s)) if _exporter is not None else None
    if stop is not None:
        stop.daemon = True
        stop.start()
    try:
        _provider.force_flush(int(timeout_s * 1000))
    finally:
        if stop is not None:
            stop.cancel()
    _provider.shutdown()
    _provider = _exporter = None


def _give_up(exporter, timeout_s: float) -> None:
    logger.warning("spans not exported within %.0f s (collector unreachable?); dropping the rest", timeout_s)
    exporter.shutdown()


def active_provider() -> TracerProvider | None:
    """The provider `setup_tracing` installed, or None when tracing is off."""
    return _provider


def get_tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    """The specdec tracer of `provider`, else of the global one (the no-op tracer when tracing is off)."""
    return trace.get_tracer(TRACER_NAME, tracer_provider=provider)


# OTEL_TRACES_SAMPLER's names (the spec's) -> the sampler, given OTEL_TRACES_SAMPLER_ARG's ratio
SAMPLERS: dict[str, Callable[[float], sdk_sampling.Sampler]] = {
    "always_on": lambda ratio: sdk_sampling.ALWAYS_ON,
    "always_off": lambda ratio: sdk_sampling.ALWAYS_OFF,
    "traceidratio": lambda ratio: sdk_sampling.TraceIdRatioBased(ratio),
    "parentbased_always_on": lambda ratio: sdk_sampling.DEFAULT_ON,
    "parentbased_always_off": lambda ratio: sdk_sampling.DEFAULT_OFF,
    "parentbased_traceidratio": lambda ratio: sdk_sampling.ParentBasedTraceIdRatio(ratio),
}
DEFAULT_SAMPLER = "parentbased_always_on"


def _sampler_name(config: TelemetryConfig) -> str:
    """The sampler `OTEL_TRACES_SAMPLER` names, or the default for a name it does not know."""
    return config.traces_sampler if config.traces_sampler in SAMPLERS else DEFAULT_SAMPLER


def sampler_label(config: TelemetryConfig) -> str:
    """The sampler in use, for the start-up line: the fallback for an unknown name (it named the unknown one, QA),
    and a ratio sampler's ratio."""
    name = _sampler_name(config)
    return f"{name}({config.traces_sampler_arg:g})" if name.endswith("traceidratio") else name


def build_sampler(config: TelemetryConfig) -> sdk_sampling.Sampler:
    """The sampler named by `OTEL_TRACES_SAMPLER` (the spec's names); an unknown name gives the default."""
    if config.traces_sampler not in SAMPLERS:
        logger.warning("OTEL_TRACES_SAMPLER=%r is not one of %s; using %s", config.traces_sampler, sorted(SAMPLERS),
                       DEFAULT_SAMPLER)
    return SAMPLERS[_sampler_name(config)](config.traces_sampler_arg)


class StepSpanSampler:
    """Decides, once per speculative step, whether that step's spans (propose, verify, extend) are recorded.

    `ratio` comes from `SPECDEC_STEP_SPAN_RATIO` (default 0.0: no step spans, so a long generation does not
    emit thousands of spans; 1.0: every step). When tracing is off, or the step is not sampled, `span()`
    returns a shared null context manager: the cost is one attribute check and a call. Build it after
    `setup_tracing` (without a `tracer` it takes the one `setup_tracing` installed, if any).

        sampled = step_spans.sample_step()
        with step_spans.span("draft.propose", sampled, batch_size=b, num_draft_tokens=k):
            ...
        with step_spans.span("draft.verify", sampled, batch_size=b, num_draft_tokens=k) as span:
            ...  # the Verify RPC: its client span and the target's server span become children
            if span is not None:
                span.set_attribute("accepted", num_accepted)
        with step_spans.span("draft.extend", sampled, batch_size=b):
            ...
    """

    def __init__(
        self,
        ratio: float,
        tracer: trace.Tracer | None = None,
        random_fn: Callable[[], float] = random.random,
    ) -> None:
        self.ratio = ratio
        self._tracer = tracer if tracer is not None else (get_tracer() if _provider is not None else None)
        self._random = random_fn
        self._always = self._tracer is not None and ratio >= 1.0
        self._never = self._tracer is None or ratio <= 0.0

    @classmethod
    def from_config(cls, config: TelemetryConfig, tracer: trace.Tracer | None = None) -> StepSpanSampler:
        return cls(config.step_span_ratio, tracer)

    def sample_step(self) -> bool:
        """True when this step's spans should be recorded."""
        if self._never:
            return False
        return self._always or self._random() < self.ratio

    def span(
        self,
        name: str,
        sampled: bool,
        links: Sequence[trace.Link] = (),
        context: otel_context.Context | None = None,
        **attributes: Any,
    ) -> contextlib.AbstractContextManager[trace.Span | None]:
        """A current span named `name` with `attributes` when `sampled`, else a null context (yields None).

        `context`: the parent (default: the current context). `links` can point at the spans of the requests
        in the batch (`trace.Link(span_context)`); `batch_parent` gives both for a batch.
        """
        span = self.start_span(name, sampled, links, context, **attributes)
        return _NULL_SPAN if span is None else trace.use_span(span, end_on_exit=True)

    def start_span(self, name: str, sampled: bool, links: Sequence[trace.Link] = (),
                   context: otel_context.Context | None = None, **attributes: Any) -> trace.Span | None:
        """`span`'s span, started without becoming current, for work that ends elsewhere (a verify sent now and
        collected later): the caller makes it current where needed (`trace.use_span(span, end_on_exit=False)`)
        and ends it. None when not `sampled`."""
        if not sampled:
            return None
        assert self._tracer is not None  # sampled is only ever True with a tracer
        return self._tracer.start_span(name, context=context, links=links, attributes=attributes)


_NULL_SPAN = contextlib.nullcontext(None)


def current_trace_context() -> otel_context.Context | None:
    """The current context when it holds a span (to carry a request's trace to another thread), else None.

    Contextvars do not follow work handed to the engine thread; store this with the request instead."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    return otel_context.get_current()


def batch_parent(
    contexts: Sequence[otel_context.Context | None],
) -> tuple[otel_context.Context | None, list[trace.Link]]:
    """Parent and links for a span that covers a whole batch of requests (a speculative step).

    The parent is the first request whose span is sampled (the step's spans join that request's trace);
    every other sampled request gets a link (Jaeger shows them as references). A request its caller did not
    trace gets none: its trace is never exported (a link would point at nothing), and its trace id would leak
    into another caller's trace. No sampled request: parent None, and the caller should record no step spans
    (they would be orphan root traces).
    """
    parent, links = None, []
    for ctx in contexts:
        if ctx is None:
            continue
        span_context = trace.get_current_span(ctx).get_span_context()
        if not (span_context.is_valid and span_context.trace_flags.sampled):
            continue
        if parent is None:
            parent = ctx
        else:
            links.append(trace.Link(span_context))
    return parent, links


def untraced_context() -> otel_context.Context:
    """A context under a sampled-out span: calls made in it pass the "not sampled" flag on (W3C traceparent), so
    neither side records spans for them (start-up warm-up traffic, not a user's request)."""
    span = trace.NonRecordingSpan(trace.SpanContext(random.getrandbits(128) or 1, random.getrandbits(64) or 1,
                                                    is_remote=False, trace_flags=trace.TraceFlags(0)))
    return trace.set_span_in_context(span)


@contextlib.contextmanager
def attached(ctx: otel_context.Context | None) -> Iterator[None]:
    """Make `ctx` current inside the block (e.g. a request's context on the engine thread); None: no-op."""
    if ctx is None:
        yield
        return
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def add_event(ctx: otel_context.Context | None, name: str, attributes: dict[str, Any]) -> None:
    """An event on the span current in `ctx` (a request's, from another thread); nothing for None or a span that
    does not record."""
    if ctx is not None:
        trace.get_current_span(ctx).add_event(name, attributes)
