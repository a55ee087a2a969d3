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


def test_a_stream_its_drain_ends_is_logged_with_the_drains_reason(fake_model, model_dir, caplog):
    """The client of a stream cut at the end of the gateway's drain gets UNAVAILABLE with the reason, and the access
    log line says it too (it read `UNAVAILABLE in 32.904 s, 370 messages` without one: the gate sets the message on
    the context after the log's wrapper saw the cancel, QA)."""
    from gateway_fakes import fake_stack, hanging_stream, status_of

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, gateway, stub):
            call = await hanging_stream(pairs, stub)
            stopping = asyncio.create_task(gateway.stop(grace_s=0.3))
            status = await status_of(call)
            await stopping
            return status

    with caplog.at_level(logging.INFO, logger="gateway.access"):
        code, details = run(body())
    assert code == "UNAVAILABLE" and "drain period (0.3 s) ended" in details
    (line,) = [r.getMessage() for r in caplog.records if "GatewayService/Generate UNAVAILABLE" in r.getMessage()]
    assert "drain period (0.3 s) ended" in line, line
