"""Logging set-up shared by the services: one root handler, text or JSON lines, request ids on every record.

    setup_logging("INFO", "json")
    with bind_request_id(request.request_id):
        logger.info("admitted", extra={"num_prompt_tokens": 12})

text: `2025-01-01 12:00:00,123 INFO specdec.x [req=abc trace=4bf9...] admitted`
json: `{"ts": "...", "level": "INFO", "logger": "specdec.x", "msg": "admitted", "request_id": "abc",
        "trace_id": "4bf9...", "span_id": "00f0...", "num_prompt_tokens": 12}`

The request id lives in a contextvar: it follows `await`s and is copied into tasks created inside the block.
trace_id/span_id appear while a sampled span is current (tracing on, the trace recorded).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import TextIO

from opentelemetry import trace

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "specdec_request_id", default=None
)

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(context)s] %(message)s"

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_OUR_FIELDS = frozenset({"request_id", "trace_id", "span_id", "context"})


# Past this many characters a request id is cut in logs: the gateway's 128 plus a retry's `~n`, with room to spare.
MAX_LOGGED_ID_CHARS = 160


def loggable_id(request_id: str | None) -> str | None:
    """`request_id` as a log line may show it. A client's id is logged before it is checked (the access log binds
    it first), so one that is not printable ASCII is `repr`-escaped (a newline cannot split the line) and a long
    one is cut with a marker (10 000 characters do not reach the log); a valid id stays as it is."""
    if request_id is None:
        return None
    plain = request_id.isascii() and request_id.isprintable()
    if plain and len(request_id) <= MAX_LOGGED_ID_CHARS:
        return request_id
    shown = request_id if plain else repr(request_id)
    if len(shown) > MAX_LOGGED_ID_CHARS:
        shown = f"{shown[:MAX_LOGGED_ID_CHARS]}...({len(request_id)} chars)"
    return shown


@contextlib.contextmanager
def bind_request_id(request_id: str | None) -> Iterator[None]:
    """Every record logged inside the block (and in tasks started inside it) carries `request_id`, made safe for a
    log line (`loggable_id`)."""
    token = request_id_var.set(loggable_id(request_id))
    try:
        yield
    finally:
        # a streaming handler closed from another context (client cancel) has nothing to undo
        with contextlib.suppress(ValueError):
            request_id_var.reset(token)


class ContextFilter(logging.Filter):
    """Adds `request_id`, `trace_id`, `span_id` (None when absent) and a text `context` to each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        span_context = trace.get_current_span().get_span_context()
        # sampled, not just valid: the warm-up's context (`untraced_context`) is valid so that its "not sampled"
        # flag travels, with tracing off too, and a sampled-out trace reaches no collector: no id worth showing
        if span_context.is_valid and span_context.trace_flags.sampled:
            record.trace_id = format(span_context.trace_id, "032x")
            record.span_id = format(span_context.span_id, "016x")
        else:
            record.trace_id = record.span_id = None
        parts = [f"req={record.request_id or '-'}"]
        if record.trace_id:
            parts.append(f"trace={record.trace_id}")
        record.context = " ".join(parts)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, request_id, [trace_id, span_id], extras, [exc]."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        if getattr(record, "trace_id", None):
            line["trace_id"] = record.trace_id
            line["span_id"] = record.span_id
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and key not in _OUR_FIELDS:
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def setup_logging(
    level: str | int = "INFO", fmt: str = "text", stream: TextIO | None = None
) -> logging.Handler:
    """Replace the root logger's handlers with one handler writing `fmt` ("text" or "json") to `stream`
    (stderr by default) at `level`; return the handler."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format {fmt!r} is not one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
    return handler
