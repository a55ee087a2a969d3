"""specdec.rpc.decode_guard: request bytes that do not parse get INVALID_ARGUMENT and a short message, with no
traceback in the log, and the server goes on serving; for protobuf's and wire.py's handlers and custom ones."""

from __future__ import annotations

import asyncio
import logging

import grpc
import grpc.aio
import pytest

from specdec.rpc import decode_guard
from specdec.rpc.channel import make_channel
from specdec.rpc.server import start_server
from specdec.v1 import target_pb2

PREFILL, GENERATE = "/specdec.v1.TargetService/Prefill", "/specdec.v1.TargetService/Generate"


def _string_field_1(raw: bytes) -> bytes:
    """A message whose field 1 (`request_id`, a string) holds `raw`: tag 0x0a, length, bytes."""
    return b"\x0a" + bytes([len(raw)]) + raw


MALFORMED = {
    "surrogate": _string_field_1(b"abc\xed\xa0\x80def"),
    "lone 0xff": _string_field_1(b"\xff"),
    "truncated character": _string_field_1(b"ab\xe2\x82"),
    "overlong encoding": _string_field_1(b"\xc0\xaf"),
    "garbage": b"\xff\xfe\xfd\x07\x00\x13",
    "length past the end": b"\x0a\x40abc",
}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


@pytest.fixture
def logs(caplog):
    for name in ("grpc", "specdec"):
        caplog.set_level(logging.DEBUG, logger=name)
    return caplog


def _assert_no_traceback(caplog) -> None:
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info or "Traceback" in r.getMessage()]
    assert not bad, [r.getMessage() for r in bad]


async def _raw_call(channel, method: str, payload: bytes, streaming: bool) -> list[bytes]:
    if streaming:
        call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        return [reply async for reply in call(payload, timeout=5)]
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    return [await call(payload, timeout=5)]


async def _expect_malformed(channel, method: str, payload: bytes, streaming: bool) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await _raw_call(channel, method, payload, streaming)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith("malformed request: "), err.value.details()
    return err.value.details()


@pytest.mark.parametrize("via_wire", [False, True], ids=["generated", "wire.add_servicer"])
@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_bytes_get_invalid_argument_and_no_traceback(fake_server, logs, via_wire, kind):
    good = target_pb2.PrefillRequest(request_id="ok", prompt_ids=[1, 2]).SerializeToString()

    async def body():
        async with fake_server(via_wire=via_wire) as (handle, _), \
                make_channel(f"127.0.0.1:{handle.bound_port}") as channel:
            details = await _expect_malformed(channel, PREFILL, MALFORMED[kind], streaming=False)
            assert "PrefillRequest" in details and "\n" not in details
            await _expect_malformed(channel, GENERATE, MALFORMED[kind], streaming=True)
            reply = target_pb2.PrefillResponse.FromString((await _raw_call(channel, PREFILL, good, False))[0])
            assert reply.request_id == "ok" and reply.first_token == 7
            streamed = await _raw_call(channel, GENERATE, good, streaming=True)
            assert [target_pb2.TargetServiceGenerateResponse.FromString(m).token_ids for m in streamed] == \
                [[0], [1], [2]]

    run(body())
    _assert_no_traceback(logs)


def test_utf8_message_names_the_problem(fake_server, logs):
    async def body():
        async with fake_server() as (handle, _), make_channel(f"127.0.0.1:{handle.bound_port}") as channel:
            assert "bad UTF-8" in await _expect_malformed(channel, PREFILL, MALFORMED["surrogate"], False)
            assert "corrupt" in await _expect_malformed(channel, PREFILL, MALFORMED["garbage"], False)

    run(body())


def test_warnings_are_rate_limited(fake_server, logs, monkeypatch):
    monkeypatch.setattr(decode_guard, "WARN_EVERY_S", 3600.0)

    async def body():
        async with fake_server() as (handle, _), make_channel(f"127.0.0.1:{handle.bound_port}") as channel:
            for _ in range(20):
                await _expect_malformed(channel, PREFILL, MALFORMED["lone 0xff"], streaming=False)

    run(body())
    warnings = [r for r in logs.records if r.name == decode_guard.__name__]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    _assert_no_traceback(logs)


def test_health_checks_and_custom_deserializers_are_guarded(logs):
    """Any exception a deserializer raises counts (here a UnicodeDecodeError); health is guarded too."""

    async def upper(text: str, context) -> str:
        return text.upper()

    handlers = {"Upper": grpc.unary_unary_rpc_method_handler(
        upper, request_deserializer=lambda b: b.decode("utf-8"))}  # grpc encodes a str reply as UTF-8
    add = lambda s: s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Text", handlers),))

    async def body():
        handle = await start_server([add], ["test.Text"], "127.0.0.1", 0)
        try:
            async with make_channel(f"127.0.0.1:{handle.bound_port}") as channel:
                details = await _expect_malformed(channel, "/test.Text/Upper", b"a\xffb", streaming=False)
                assert "can't decode byte 0xff" in details
                assert await _raw_call(channel, "/test.Text/Upper", b"abc", streaming=False) == [b"ABC"]
                await _expect_malformed(channel, "/grpc.health.v1.Health/Check", b"\x0a\x01\xff", streaming=False)
        finally:
            await handle.stop(grace_s=None)

    run(body())
    _assert_no_traceback(logs)
