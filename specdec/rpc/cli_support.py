"""Run a service's async `serve(args, shutdown)` from the CLI: logging set up, start-up errors as one line."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn

from specdec.errors import SpecdecError
from specdec.rpc.parent_watch import exit_with_parent
from specdec.rpc.server import run_server_forever
from specdec.telemetry import setup_logging


def run_cli_service(args, serve) -> NoReturn:
    """Run the service until it has drained and stopped, then end the process: exit 0, or 2 after a start-up
    error (one line, `error: ...`). Started by `specdec up`, it also ends when `up` does (`exit_with_parent`)."""
    setup_logging(getattr(args, "log_level", "INFO"), getattr(args, "log_format", "text"))
    exit_with_parent(getattr(args, "drain_seconds", 30.0))
    code = 0
    try:
        run_server_forever(lambda shutdown: serve(args, shutdown))
    except SpecdecError as exc:
        logging.getLogger("specdec").error("start-up failed: %s", exc)
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    end_process(code)


def end_process(code: int) -> NoReturn:
    """Exit now, with logs and standard streams flushed, skipping the interpreter's teardown: the service has
    stopped its engine and exported its spans already, and the teardown only made Triton's nanobind bindings
    report ~30 lines of "leaked instances / types / functions" to stderr at every clean shutdown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
