"""The Python client's arguments: a str `stop` is one stop string, and values of the wrong type are `InvalidInput`
(a ValueError naming the argument) before any call, not a bare TypeError from protobuf."""

from __future__ import annotations

import asyncio

import pytest
from conftest import SCRIPT_TEXT
from gateway_fakes import fake_stack, run

from gateway.client import GatewayClient
from specdec.errors import InvalidInput

STOP = "(n - 2"  # several tokens into the script's text; split into characters, " " ends it at once


def test_a_str_stop_is_one_stop_string(fake_model, model_dir):
    """QA: `stop="fib("` was sent as the stops f, i, b, ( (`list(stop)`): the text ended at its first "f"."""
    async def body():
        async with fake_stack(fake_model, model_dir) as (_, gateway, _):
            return await asyncio.to_thread(complete_both, f"127.0.0.1:{gateway.port}")

    def complete_both(addr: str):
        with GatewayClient(addr, timeout_s=20) as client:
            return [client.complete("def fib(n):", max_new_tokens=100, stop=stop) for stop in (STOP, [STOP])]

    (text, stats), (listed_text, listed_stats) = run(body())
    assert text == listed_text == SCRIPT_TEXT[: SCRIPT_TEXT.index(STOP)] and "fib(n - 1)" in text
    assert stats.completion_tokens == listed_stats.completion_tokens and stats.finish_reason == "stop"


@pytest.mark.parametrize(("stop", "shown"), [(["fib(", 3], "int 3"), ([None], "NoneType None"), (5, "int 5"),
                                             ([b"fib("], "bytes b'fib('")])
def test_a_stop_that_is_not_text_is_invalid_input(stop, shown):
    with GatewayClient("127.0.0.1:1") as client, pytest.raises(InvalidInput) as raised:
        client.generate("def fib(n):", stop=stop)
    assert str(raised.value) == f"bad request: stop must be a str or a list of str, not {shown}"


@pytest.mark.parametrize(("call", "arg", "message"), [
    ("detokenize", [1.5], "bad request: token_ids must be a list of int token ids"),
    ("detokenize", None, "bad request: token_ids must be a list of int token ids"),
    ("tokenize", None, "bad request: the input must be a str or a list of chat messages, not NoneType"),
    ("tokenize", 42, "bad request: the input must be a str or a list of chat messages, not int"),
    ("generate", None, "bad request: the input must be a str or a list of chat messages, not NoneType"),
    # a lone surrogate (a non-UTF-8 byte of a command line): protobuf's bare UnicodeEncodeError before (QA)
    ("tokenize", "a\ud800b", "bad request: text: UnicodeEncodeError"),
    ("tokenize", [{"role": "user", "content": "a\ud800b"}], "bad request: chat message 0: UnicodeEncodeError"),
    ("generate", [{"role": "user", "content": "a\ud800b"}], "bad request: chat message 0: UnicodeEncodeError"),
])
def test_tokenize_detokenize_and_generate_refuse_wrong_types_as_invalid_input(call, arg, message):
    """QA: `detokenize([1.5])` and `tokenize(None)` raised protobuf's (or enumerate's) bare TypeError."""
    with GatewayClient("127.0.0.1:1") as client, pytest.raises(InvalidInput) as raised:
        getattr(client, call)(arg)
    assert str(raised.value).startswith(message) and isinstance(raised.value, ValueError)


def test_a_stream_cancelled_while_iterated_ends_quietly_and_a_closed_client_says_so(fake_model, model_dir):
    """`stream.cancel()` inside `for text in stream` made the next iteration raise gRPC's own CANCELLED ("Locally
    cancelled by application!"), and a call on a closed client a bare `ValueError: Cannot invoke RPC: Channel
    closed!` (QA)."""
    async def body():
        async with fake_stack(fake_model, model_dir) as (_, gateway, _):
            return await asyncio.to_thread(use, f"127.0.0.1:{gateway.port}")

    def use(addr: str):
        with GatewayClient(addr, timeout_s=20) as client:
            stream = client.generate("def fib(n):", max_new_tokens=100, ignore_eos=True)
            texts = []
            for text in stream:
                texts.append(text)
                if len(texts) == 2:
                    stream.cancel()
            full, _ = client.complete("def fib(n):", max_new_tokens=8)  # the client goes on
        with pytest.raises(RuntimeError, match="this GatewayClient is closed"):
            client.complete("def fib(n):", max_new_tokens=8)
        with pytest.raises(RuntimeError, match="this GatewayClient is closed"):
            client.tokenize("x")
        return texts, stream.stats, full

    texts, stats, full = run(body())
    assert len(texts) == 2 and stats is None and full


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), 0, -1, "5", True])
def test_a_timeout_no_call_could_keep_is_refused_when_the_client_is_made(timeout_s):
    """QA: inf, nan, 0 and -1 made every call fail at once with DEADLINE_EXCEEDED; True was a 1 s deadline."""
    with pytest.raises(InvalidInput, match="timeout_s must be a positive finite number of seconds or None"):
        GatewayClient("127.0.0.1:9", timeout_s=timeout_s)


def test_none_stops_are_no_stops_and_a_stream_left_by_break_ends_quietly_when_iterated_again(fake_model, model_dir):
    """`stop=None`, `stop_token_ids=None`: not set, as for the other fields (QA: InvalidInput). A stream the caller
    left with `break` ends at once when iterated again (QA: gRPC's CANCELLED raw)."""
    async def body():
        async with fake_stack(fake_model, model_dir) as (_, gateway, _):
            return await asyncio.to_thread(use, f"127.0.0.1:{gateway.port}")

    def use(addr: str):
        with GatewayClient(addr, timeout_s=20) as client:
            text, _ = client.complete("def fib(n):", max_new_tokens=100, stop=None, stop_token_ids=None)
            stream = client.generate("def fib(n):", max_new_tokens=100, ignore_eos=True)
            for _ in stream:
                break
            return text, list(stream), stream.stats

    text, again, stats = run(body())
    assert text == SCRIPT_TEXT and again == [] and stats is None


def test_an_empty_chat_message_from_stdin_is_refused_before_anything_is_sent(capsys, monkeypatch):
    """`specdec generate --chat -` with nothing on stdin sent a chat of one empty message and exited 0 (QA); a
    plain empty prompt is refused by the gateway. Nothing listens at the address: the refusal comes first."""
    import io

    from specdec.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert main(["generate", "--addr", "127.0.0.1:9", "--chat", "-"]) == 2
    assert "error: the chat message is empty (stdin gave no text)" in capsys.readouterr().err
