"""setup_logging in both formats; the request id follows awaits and tasks; trace ids appear inside spans."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from specdec.engine.warmup import warm_verify_shapes
from specdec.telemetry import bind_request_id, setup_logging
from specdec.telemetry.logs import loggable_id
from specdec.telemetry.tracing import active_provider

logger = logging.getLogger("specdec.test")


@pytest.fixture
def capture():
    """Yields fmt -> StringIO: (re)configures logging into a fresh buffer. Restores the root logger after."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)

    def configure(fmt: str) -> io.StringIO:
        buffer = io.StringIO()
        setup_logging("DEBUG", fmt, stream=buffer)
        return buffer

    yield configure
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])


def test_one_root_handler_and_bad_format_rejected(capture):
    capture("text")
    capture("json")
    assert len(logging.getLogger().handlers) == 1
    with pytest.raises(ValueError, match="text, json"):
        setup_logging("INFO", "xml")


def test_text_lines_carry_the_request_id(capture):
    buffer = capture("text")
    logger.info("outside")
    with bind_request_id("r-42"):
        logger.warning("inside %d", 7)
    first, second = buffer.getvalue().splitlines()
    assert first.endswith("INFO specdec.test [req=-] outside")
    assert second.endswith("WARNING specdec.test [req=r-42] inside 7")


def test_json_lines_have_fields_extras_and_trace_ids(capture):
    buffer = capture("json")
    tracer = TracerProvider().get_tracer("t")
    with bind_request_id("r-1"), tracer.start_as_current_span("work") as span:
        logger.info("admitted", extra={"num_prompt_tokens": 12})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed")
    inside, failed = (json.loads(line) for line in buffer.getvalue().splitlines())
    assert {"ts", "level", "logger", "msg", "request_id"} <= set(inside)
    assert (inside["level"], inside["logger"], inside["msg"]) == ("INFO", "specdec.test", "admitted")
    assert inside["request_id"] == "r-1" and inside["num_prompt_tokens"] == 12
    assert inside["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert inside["span_id"] == format(span.get_span_context().span_id, "016x")
    assert failed["request_id"] is None and "trace_id" not in failed
    assert "RuntimeError: boom" in failed["exc"]


def test_request_id_survives_awaits_and_stays_per_task(capture):
    buffer = capture("json")

    async def handle(request_id: str, delay_s: float) -> None:
        with bind_request_id(request_id):
            await asyncio.sleep(delay_s)
            logger.info("after await")
            await asyncio.create_task(child())  # a task started inside the block inherits the id

    async def child() -> None:
        await asyncio.sleep(0)
        logger.info("in child task")

    async def main() -> None:
        await asyncio.gather(handle("a", 0.02), handle("b", 0.0))
        logger.info("done")

    asyncio.run(main())
    records = [json.loads(line) for line in buffer.getvalue().splitlines()]
    lines = [(record["request_id"], record["msg"]) for record in records if record["logger"] == logger.name]
    assert lines == [
        ("b", "after await"), ("b", "in child task"),
        ("a", "after await"), ("a", "in child task"),
        (None, "done"),
    ]  # fmt: skip


def test_a_request_id_is_logged_escaped_and_cut_but_a_valid_one_as_it_is(capture):
    """A client's id reaches the logs before it is checked: a newline must not split a line, 10 000 characters
    must not fill one; a valid id (a gateway retry's `~n` included) is unchanged."""
    valid = "r" * 128 + "~2"
    assert loggable_id(valid) == valid and loggable_id(None) is None
    assert loggable_id("a\nb") == "'a\\nb'"
    long = loggable_id("x" * 10_000)
    assert long == "x" * 160 + "...(10000 chars)"
    buffer = capture("text")
    with bind_request_id("evil\n2025-01-01 00:00:00,000 INFO forged"):
        logger.info("one line")
    assert len(buffer.getvalue().splitlines()) == 1 and "[req='evil\\n2025" in buffer.getvalue()


class WarmUpTarget:
    """Answers the warm-up's Prefill / Verify / Release with nothing: only its log lines matter here."""

    def prefill(self, inputs):
        return []

    def verify(self, inputs):
        return []

    def release(self, request_id):
        pass


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_warm_up_lines_carry_no_trace_id_with_tracing_off(capture, fmt):
    """The warm-up runs under a sampled-out span (its calls pass "not sampled" on, so a traced target records
    nothing): its context is valid, but there is no trace to point at, so its lines show no trace id. A sampled
    span's lines still do."""
    assert active_provider() is None  # tracing off, as without an OTLP endpoint
    buffer = capture(fmt)
    warm_verify_shapes(WarmUpTarget(), [2], topk=1, feature_layers=(), vocab_size=16)
    with TracerProvider().get_tracer("t").start_as_current_span("work") as span:
        logger.info("traced")
    warm_up, traced = buffer.getvalue().splitlines()
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert "verify warm-up: 2 shapes" in warm_up and "trace" not in warm_up
    assert (f"trace={trace_id}]" in traced) if fmt == "text" else (json.loads(traced)["trace_id"] == trace_id)
