"""The telemetry flags every service's CLI shares (tracing itself is configured by OTEL_* variables)."""

from __future__ import annotations

import argparse

from specdec.serving.engine_args import port
from specdec.telemetry.logs import LOG_FORMATS

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_telemetry_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `--metrics-port`, `--log-format`, `--log-level` to `parser` (in their own group); return it."""
    group = parser.add_argument_group(
        "telemetry (tracing: OTEL_* environment variables, see docs/observability.md)"
    )
    group.add_argument(
        "--metrics-port",
        type=port("off"),
        default=0,
        help="serve Prometheus metrics on this port at /metrics (0 = off; default 0)",
    )
    group.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text lines or one JSON object per line (default text)",
    )
    group.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default="INFO",
        help="root log level (default INFO)",
    )
    return parser
