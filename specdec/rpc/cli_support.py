"""Run a service's async `serve(args, shutdown)` from the CLI: logging set up, start-up errors as one line."""

from __future__ import annotations

import logging
import sys

from specdec.errors import SpecdecError
from specdec.rpc.server import run_server_forever
from specdec.telemetry import setup_logging


def run_cli_service(args, serve) -> int:
    setup_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"))
    try:
        run_server_forever(lambda shutdown: serve(args, shutdown))
    except SpecdecError as exc:
        logging.getLogger("specdec").error("start-up failed: %s", exc)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
