"""A request waiting for KV pages is asked for again every few milliseconds: those Prefills stay out of its trace
(QA: a 30 s wait put ~4,600 RESOURCE_EXHAUSTED Prefill spans in one trace); its first refusal is in it, and its
admission after the wait is one `specdec.waited_for_pages` event on its span."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from repo_paths import TINY

from specdec.engine.factory import EngineOptions, build_target
from specdec.engine.requests import PrefillInput
from specdec.engine.scheduler import Scheduler
from specdec.sampling_params import SamplingParams

PROMPT = list(range(3, 13))
PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)


class Recording:
    """The engine, with the trace each prefill ran under recorded (sampled or not)."""

    def __init__(self, engine) -> None:
        self.engine, self.sampled = engine, []

    def prefill(self, inputs):
        self.sampled.append(trace.get_current_span().get_span_context().trace_flags.sampled)
        return self.engine.prefill(inputs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def engine():
    return build_target(str(TINY / "target"), EngineOptions(num_pages=12, max_batch_size=8))  # two such requests


def test_a_waiting_requests_prefills_stay_out_of_its_trace(engine):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    for rid in ("a", "b"):
        engine.prefill([PrefillInput(rid, PROMPT, PARAMS, ())])
    target = Recording(engine)
    sched = Scheduler(target, None, engine.max_context, 4, max_queue_wait_s=30.0)
    span = tracer.start_span("request")  # open while the request runs (the draft's Generate server span)
    sched.add("w", PROMPT, PARAMS, trace_context=trace.set_span_in_context(span))
    for _ in range(5):  # refused, then asked again (the retry interval passes between steps)
        sched._retry_at = 0.0
        sched.step()
    assert sched.waiting and target.sampled[0] is True and len(target.sampled) >= 3
    assert not any(target.sampled[1:])  # the retries ran under a sampled-out context: no spans either side
    engine.release("a")
    sched._retry_at = 0.0
    sched.step()
    assert "w" in sched.running and target.sampled[-1] is False
    span.end()
    (event,) = [e for e in span.events if e.name == "specdec.waited_for_pages"]
    assert event.attributes["seconds"] >= 0
    sched.abort("w")
    sched.step()
    engine.release("b")
    assert engine.kv.num_free_pages == engine.kv.num_total_pages
