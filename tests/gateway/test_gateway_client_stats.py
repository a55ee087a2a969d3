"""The Python client's `GenerationStats` (every `GatewayStats` field), its chat-message checks, and `specdec generate`'s
stats line and error text."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import sys

import grpc
import pytest
from conftest import SCRIPT_TEXT
from gateway_fakes import fake_stack, run

from gateway.client import GatewayClient, GenerationStats
from gateway.commands import format_stats, rpc_error_text
from specdec.cli import main as cli_main
from specdec.errors import InvalidInput
from specdec.v1 import common_pb2, gateway_pb2


def stats(**fields) -> GenerationStats:
    base = {"finish_reason": "length", "prompt_tokens": 8, "completion_tokens": 24, "tau": 0.0,
            "accepted_per_position": (), "time_to_first_token_s": 0.09, "total_s": 0.45, "speculative": False,
            "request_id": "r1"}
    return GenerationStats(**{**base, **fields})


def test_the_client_stats_carry_every_gateway_stats_field():
    """QA: `fallbacks` (GatewayStats field 10) was dropped. Each field of the message is one of the stats, by the
    same name, so a field added to the proto and not to the client fails here."""
    msg = gateway_pb2.GatewayStats(
        finish_reason=common_pb2.FINISH_REASON_STOP, prompt_tokens=8, completion_tokens=24, tau=3.5,
        accepted_per_position=[5, 4], time_to_first_token_s=0.09, total_s=0.45, speculative=True, request_id="r1",
        fallbacks=2,
    )
    got = GenerationStats.from_proto(msg)
    proto_fields = [f.name for f in gateway_pb2.GatewayStats.DESCRIPTOR.fields]
    assert proto_fields == [f.name for f in dataclasses.fields(GenerationStats)]
    assert got == GenerationStats("stop", 8, 24, 3.5, (5, 4), 0.09, 0.45, True, "r1", fallbacks=2)


def test_the_stats_line_says_fallbacks_only_when_there_were_some():
    assert format_stats(stats()) == ("[24 tokens in 0.45 s, 53.3 tokens/s, no speculation, first text after 0.09 s, "
                                     "prompt 8 tokens, finish length]")
    assert format_stats(stats(fallbacks=1)).endswith("finish length, 1 fallback]")
    assert format_stats(stats(fallbacks=2)).endswith("finish length, 2 fallbacks]")


def test_the_client_reports_a_fallback_when_the_draft_fails_mid_stream(fake_model, model_dir):
    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, gateway, _):
            pairs[0].draft.fail_after_chunks = 2
            return await asyncio.to_thread(complete, f"127.0.0.1:{gateway.port}")

    def complete(addr: str):
        with GatewayClient(addr, timeout_s=20) as client:
            return client.complete("def fib(n):", max_new_tokens=100)

    text, final = run(body())
    assert text == SCRIPT_TEXT and final.fallbacks == 1 and not final.speculative
    assert format_stats(final).endswith(", 1 fallback]")


@pytest.mark.parametrize("messages, said", [
    ([{"role": "user"}], "chat message 0 has no 'content' (each needs 'role' and 'content')"),
    ([{"role": "user", "content": "hi"}, {"content": "x"}], "chat message 1 has no 'role'"),
    ([{"role": "user", "content": 3}], "chat message 0's 'content' is a int, not a str"),
    (["hi"], "chat message 0 is a str, not a dict with 'role' and 'content'"),
])
def test_the_client_names_the_chat_message_and_key_it_cannot_send(messages, said):
    """Checked before any call (nothing listens at the address). QA: `complete([{"role": "user"}])` said only
    `bad request: KeyError: 'content'`."""
    with GatewayClient("127.0.0.1:9") as client:
        for send in (client.complete, client.tokenize):
            with pytest.raises(InvalidInput) as err:
                send(messages)
            assert said in str(err.value)


def test_generate_says_its_timeout_ran_out(fake_model, model_dir, capsys, monkeypatch):
    """QA: `specdec generate --timeout 0.3` ended with `DEADLINE_EXCEEDED: Stream removed (Deadline Exceeded)`.
    (Run on a thread beside the fake stack's loop, where no signal handler can be set.)"""
    monkeypatch.setattr("gateway.commands.sigterm_as_interrupt", contextlib.nullcontext)

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, gateway, _):
            pairs[0].draft.hang_after_chunks = 2
            return await asyncio.to_thread(cli_main, ["generate", "--addr", f"127.0.0.1:{gateway.port}",
                                                      "--timeout", "0.3", "def fib(n):"])

    assert run(body()) == 1
    said = capsys.readouterr().err.strip()
    assert said.endswith("error: DEADLINE_EXCEEDED: the request's --timeout of 0.3 s ran out")


def test_generate_into_a_closed_pipe_ends_quietly(fake_model, model_dir, capsys, monkeypatch):
    """`specdec generate ... | head -c 50`: the reader leaves, the command ends with status 0 and no traceback, its
    request cancelled on the way out (QA: a BrokenPipeError traceback, exit 1)."""
    monkeypatch.setattr("gateway.commands.sigterm_as_interrupt", contextlib.nullcontext)
    read_end, write_end = os.pipe()
    os.close(read_end)
    closed = open(write_end, "w")  # noqa: SIM115 - closed below
    monkeypatch.setattr(sys, "stdout", closed)

    async def body():
        async with fake_stack(fake_model, model_dir) as (_, gateway, _):
            return await asyncio.to_thread(cli_main, ["generate", "--addr", f"127.0.0.1:{gateway.port}", "def f"])

    try:
        assert run(body()) == 0
    finally:
        with contextlib.suppress(OSError):
            closed.close()
    assert "Traceback" not in capsys.readouterr().err


def test_a_socket_closed_after_text_arrived_gets_no_tls_hint():
    """A gateway killed mid-stream closes the socket too: that is not a handshake refused (QA: the error said to
    pass --tls-ca). Before any text, the hint stays."""
    class Closed(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "Stream removed (Socket closed)"

    assert "--tls-ca" in rpc_error_text(Closed(), None)
    assert rpc_error_text(Closed(), None, connected=True) == "UNAVAILABLE: Stream removed (Socket closed)"


def test_a_gateway_address_that_is_not_grpc_is_named_as_such(http1_addr, capsys):
    """`specdec generate --addr` at an HTTP/1 port printed gRPC's "Failed parsing HTTP/2 (Expected SETTINGS
    frame ...)" alone (QA)."""
    assert cli_main(["generate", "--addr", http1_addr, "def f"]) != 0
    err = capsys.readouterr().err
    assert "UNAVAILABLE: the gateway address answered, but not in gRPC's HTTP/2" in err
    assert "Traceback" not in err
