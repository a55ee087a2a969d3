"""The verify lane's two ends (`specdec.rpc.lane_server`, `specdec.rpc.lane_client`) over real sockets: replies,
statuses, deadlines, pipelined calls in order, a connection that breaks, and frames that break the protocol (the
server answers or closes that connection, and serves the next one)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import grpc
import grpc.aio
import pytest

from specdec.rpc.lane import CALL, HEADER, MAGIC, REPLY, STATUS, encode_head, frame, status_from
from specdec.rpc.lane_client import LaneClient, LaneDown
from specdec.rpc.lane_server import LaneServer

LIMIT = 1 << 20


class _Handlers:
    def __init__(self) -> None:
        self.order: list[bytes] = []
        self.cancelled = 0

    async def echo(self, request: bytes, context) -> bytes:
        self.order.append(request)
        meta = dict(context.invocation_metadata())
        return request + meta.get("traceparent", "").encode()

    async def abort(self, request: bytes, context) -> bytes:
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.decode()!r}")

    async def slow(self, request: bytes, context) -> bytes:
        try:
            await asyncio.sleep(float(request.decode()))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return b"late"

    async def fails(self, request: bytes, context) -> bytes:
        raise RuntimeError("a bug")


class _Refusing(grpc.aio.ServerInterceptor):
    """An interceptor that refuses one method, as the readiness gate refuses calls while loading."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if details.method != "/t.S/Refused":
            return handler

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "loading")
        return grpc.unary_unary_rpc_method_handler(refuse)


@pytest.fixture
def lane():
    impl = _Handlers()
    handlers = {f"/t.S/{name.capitalize()}": grpc.unary_unary_rpc_method_handler(getattr(impl, name))
                for name in ("echo", "abort", "slow", "fails")}
    handlers["/t.S/Refused"] = handlers["/t.S/Echo"]
    loop = asyncio.new_event_loop()
    server = LaneServer(handlers, [_Refusing()], handlers, LIMIT)
    port = loop.run_until_complete(server.start("127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    client = LaneClient("127.0.0.1", port, LIMIT)
    yield client, impl, port
    client.close()
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_a_call_gets_its_reply_and_metadata_reaches_the_handler(lane):
    client, _, _ = lane
    assert client.call("/t.S/Echo", b"abc", 5.0) == b"abc"
    assert client.call("/t.S/Echo", b"x" * 300_000, 5.0, [("traceparent", "00-tp")]) == b"x" * 300_000 + b"00-tp"


def test_statuses_come_back_as_the_handler_and_interceptors_set_them(lane):
    client, _, _ = lane
    with pytest.raises(grpc.RpcError) as err:
        client.call("/t.S/Abort", b"r7", 5.0)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details() == "no request 'r7'"
    with pytest.raises(grpc.RpcError) as err:
        client.call("/t.S/Refused", b"", 5.0)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE, "loading")
    with pytest.raises(grpc.RpcError) as err:
        client.call("/t.S/Fails", b"", 5.0)
    assert err.value.code() == grpc.StatusCode.INTERNAL and "RuntimeError: a bug" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.call("/t.S/Nothing", b"", 5.0)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert client.call("/t.S/Echo", b"still", 5.0) == b"still"  # the connection goes on after each status


def test_a_call_past_its_deadline_ends_and_the_server_cancels_it(lane):
    client, impl, _ = lane
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        client.call("/t.S/Slow", b"3", 0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 2.0
    assert client.call("/t.S/Echo", b"next", 5.0) == b"next"  # on a new connection
    deadline = time.monotonic() + 3
    while impl.cancelled < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert impl.cancelled == 1  # the handler did not run on for a caller that gave up


def test_pipelined_calls_of_a_thread_arrive_in_order_and_are_collected_in_any(lane):
    client, impl, _ = lane
    calls = [client.start("/t.S/Echo", str(i).encode(), 5.0) for i in range(20)]
    assert [c.result() for c in reversed(calls)] == [str(i).encode() for i in reversed(range(20))]
    assert impl.order == [str(i).encode() for i in range(20)]


def test_threads_call_at_once(lane):
    client, _, _ = lane
    results: dict[int, list[bytes]] = {}

    def work(t: int) -> None:
        results[t] = [client.call("/t.S/Echo", f"{t}-{i}".encode(), 5.0) for i in range(30)]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == {t: [f"{t}-{i}".encode() for i in range(30)] for t in range(4)}


def test_close_ends_a_waiting_call_unavailable(lane):
    client, _, _ = lane
    call = client.start("/t.S/Slow", b"5", 10.0)
    threading.Timer(0.2, client.close).start()
    with pytest.raises(grpc.RpcError) as err:
        call.result()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(LaneDown):
        client.call("/t.S/Echo", b"", 1.0)


def test_no_lane_at_the_port_is_lane_down_before_anything_is_sent():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: refused
    with pytest.raises(LaneDown):
        LaneClient("127.0.0.1", port, LIMIT).call("/t.S/Echo", b"", 1.0)


def _raw(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(MAGIC)
    assert sock.recv(len(MAGIC), socket.MSG_WAITALL) == MAGIC
    return sock


def _answer(sock: socket.socket):
    header = sock.recv(HEADER.size, socket.MSG_WAITALL)
    call_id, kind, len1, len2 = HEADER.unpack(header)
    part1 = sock.recv(len1, socket.MSG_WAITALL) if len1 else b""
    part2 = sock.recv(len2, socket.MSG_WAITALL) if len2 else b""
    return call_id, kind, part1, part2


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


@pytest.mark.parametrize("case", ["greeting", "kind", "oversized", "head"])
def test_frames_that_break_the_protocol_end_that_connection_only(lane, case):
    client, _, port = lane
    if case == "greeting":
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _closed(sock)
    elif case == "head":  # a head that is not one: that call gets INVALID_ARGUMENT, the connection goes on
        sock = _raw(port)
        sock.sendall(frame(4, CALL, b"\xff\xfe", b""))
        call_id, kind, part1, part2 = _answer(sock)
        assert (call_id, kind, status_from(part1, part2).code()) == (4, STATUS, grpc.StatusCode.INVALID_ARGUMENT)
        sock.sendall(frame(5, CALL, encode_head("/t.S/Echo", 5.0), b"ok"))
        assert _answer(sock) == (5, REPLY, b"", b"ok")
    else:
        sock = _raw(port)
        bad = (HEADER.pack(9, 7, 0, 0) if case == "kind" else HEADER.pack(9, CALL, 10, LIMIT + 1))
        sock.sendall(bad)
        call_id, kind, part1, part2 = _answer(sock)
        status = status_from(part1, part2)
        expected = grpc.StatusCode.INVALID_ARGUMENT if case == "kind" else grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (call_id, kind, status.code()) == (9, STATUS, expected)
        assert _closed(sock)
    sock.close()
    assert client.call("/t.S/Echo", b"after", 5.0) == b"after"  # the server goes on


def test_a_traced_call_gets_its_server_span_under_the_callers_client_span():
    """The server's tracing interceptor runs on lane calls: a SERVER span, child of the caller's CLIENT span (made
    by `blocking_call_metadata`, as the draft's client does), with the handler's status."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode

    from specdec.telemetry.grpc_tracing import blocking_call_metadata, server_interceptors

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    impl = _Handlers()
    handlers = {"/t.S/Echo": grpc.unary_unary_rpc_method_handler(impl.echo),
                "/t.S/Abort": grpc.unary_unary_rpc_method_handler(impl.abort)}
    loop = asyncio.new_event_loop()
    server = LaneServer(handlers, server_interceptors(provider, handlers), handlers, LIMIT)
    port = loop.run_until_complete(server.start("127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    client = LaneClient("127.0.0.1", port, LIMIT)
    tracer = provider.get_tracer("test")
    try:
        with tracer.start_as_current_span("step"):
            for method in ("/t.S/Echo", "/t.S/Abort"):
                with contextlib.suppress(grpc.RpcError), \
                        blocking_call_metadata(method, tracer=tracer) as metadata:
                    client.call(method, b"r1", 5.0, metadata)
    finally:
        client.close()
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    spans = {(s.name, s.kind): s for s in exporter.get_finished_spans()}
    for method, status in (("Echo", StatusCode.UNSET), ("Abort", StatusCode.ERROR)):
        client_span = spans[(f"t.S/{method}", SpanKind.CLIENT)]
        server_span = spans[(f"t.S/{method}", SpanKind.SERVER)]
        assert server_span.parent.span_id == client_span.context.span_id
        assert server_span.context.trace_id == spans[("step", SpanKind.INTERNAL)].context.trace_id
        assert server_span.status.status_code == client_span.status.status_code == status


def test_a_server_restarted_between_calls_gets_the_next_call_on_a_new_connection():
    """A target restarted (same port) while a draft thread was idle: that thread's connection is closed; its next
    call opens a new one instead of failing UNAVAILABLE on the old one."""
    impl = _Handlers()
    handlers = {"/t.S/Echo": grpc.unary_unary_rpc_method_handler(impl.echo)}
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def serve(port: int) -> LaneServer:
        server = LaneServer(handlers, [], handlers, LIMIT)
        asyncio.run_coroutine_threadsafe(server.start("127.0.0.1", port), loop).result(5)
        return server

    first = serve(0)
    client = LaneClient("127.0.0.1", first.port, LIMIT)
    try:
        assert client.call("/t.S/Echo", b"before", 5.0) == b"before"
        asyncio.run_coroutine_threadsafe(first.stop(), loop).result(5)
        second = serve(first.port)
        time.sleep(0.1)  # the old connection's end has reached this side
        assert client.call("/t.S/Echo", b"after", 5.0) == b"after"
        asyncio.run_coroutine_threadsafe(second.stop(), loop).result(5)
    finally:
        client.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_a_connection_that_never_greets_is_closed(lane, monkeypatch):
    import specdec.rpc.lane_server as lane_server

    monkeypatch.setattr(lane_server, "GREETING_S", 0.2)
    client, _, port = lane
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    assert _closed(sock)  # after GREETING_S, not the socket's 5 s timeout
    sock.close()
    assert client.call("/t.S/Echo", b"ok", 5.0) == b"ok"


def test_a_client_that_does_not_read_its_replies_is_held_back(lane):
    """Replies wait to be sent before the connection's next calls are read: a client sending calls without reading
    its replies soon cannot send more (before, every reply piled up in the server's memory: +800 MiB, QA)."""
    client, _, port = lane
    sock = _raw(port)
    sock.settimeout(3.0)
    call = frame(1, CALL, encode_head("/t.S/Echo", 5.0), bytes(64 * 1024))
    sent = 0
    with pytest.raises(TimeoutError):
        for _ in range(2000):  # 128 MB of replies if nothing held it back
            sock.sendall(call)
            sent += 1
    assert sent < 1000
    sock.close()
    assert client.call("/t.S/Echo", b"others", 5.0) == b"others"


def test_a_call_head_with_an_absurd_timeout_is_invalid_argument(lane):
    _, _, port = lane
    sock = _raw(port)
    sock.sendall(frame(3, CALL, b"/t.S/Echo\n" + b"9" * 400, b"x"))
    call_id, kind, part1, part2 = _answer(sock)
    assert (call_id, kind, status_from(part1, part2).code()) == (3, STATUS, grpc.StatusCode.INVALID_ARGUMENT)
    sock.close()
