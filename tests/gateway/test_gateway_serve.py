"""`serve`, the gateway's process life from its flags, in-process over a fake pair: start, drain, stop."""

from __future__ import annotations

import asyncio
import logging

from gateway_fakes import run, start_fake_pair

from gateway.serve import serve
from specdec.cli import build_parser


def test_the_gateway_logs_a_stopped_line_as_the_model_services_do(fake_model, model_dir, caplog):
    """Its last line says it is gone (after the drain, the router closed, spans flushed), as the draft's and the
    target's `<name> stopped` (`run_service`) do: a log that ends at "draining" may be a process that hung."""

    async def body():
        pair = await start_fake_pair(fake_model)
        args = build_parser().parse_args(["serve-gateway", "--model", model_dir, "--pair", str(pair.address),
                                          "--host", "127.0.0.1", "--port", "0", "--drain-seconds", "0.1"])
        shutdown = asyncio.Event()
        try:
            await serve(args, shutdown, ready=lambda port: shutdown.set())
        finally:
            await pair.draft_handle.stop(None)
            await pair.target_handle.stop(None)

    with caplog.at_level(logging.INFO):
        run(body())
    messages = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    draining = next(i for i, m in enumerate(messages) if m.startswith("gateway draining"))
    assert messages[draining + 1 :].count("gateway stopped") == 1, messages
