"""The server end of the verify lane (`specdec.rpc.lane`): chosen unary methods of a gRPC server, served over plain
TCP connections by the same handlers and interceptors.

Each call is run the way the gRPC server would run it: the interceptor chain (drain gate, readiness gate, tracing,
decode guard) builds the handler from the method's registered one, its request deserializer reads the request,
and the behaviour runs with a `LaneContext` (the parts of `grpc.aio.ServicerContext` specdec's handlers and
interceptors use). So a call refused while loading or draining, an unknown request id, a request that does not
parse, an abort: each ends with the status and details its gRPC call would have.

A connection that sends anything else than frames of calls (a bad magic, a frame of another kind, a part over
its limit, a method the lane does not serve) gets a STATUS where one can be sent and is closed; the server and its
other connections go on. A connection that closes cancels its calls still running, as a gRPC client that leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Mapping, Sequence

import grpc
import grpc.aio

from specdec.rpc.errors import status_for
from specdec.rpc.lane import CALL, HEADER, MAGIC, MAX_HEAD_BYTES, REPLY, decode_head, frame, status_frame

log = logging.getLogger(__name__)

GREETING_S = 10.0  # a connection that has not sent the lane's greeting by then is closed
STRANGER_LOG_S = 60.0  # a connection that does not greet as a lane is logged once a minute at most
MAX_CALLS_PER_CONNECTION = 128  # calls of one connection running at once (gRPC's default stream limit is 100)


class _Abort(grpc.aio.AbortError):
    pass


class LaneContext:
    """What a lane call's handler and interceptors read and set of a gRPC servicer context."""

    def __init__(self, metadata: tuple[tuple[str, str], ...], timeout_s: float | None, peer: str) -> None:
        self._metadata, self._peer = metadata, peer
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._code: grpc.StatusCode | None = None
        self._details: str | None = None

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def peer(self) -> str:
        return self._peer

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str | None:
        return self._details

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        self._code, self._details = code, details
        raise _Abort()

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False


class _Details:
    """`grpc.HandlerCallDetails` of a lane call."""

    def __init__(self, method: str, metadata) -> None:
        self.method, self.invocation_metadata = method, metadata


class LaneServer:
    """Serves `methods` (full names, unary-unary) of `handlers` (full name -> registered handler) through
    `interceptors` (the gRPC server's chain, outermost first)."""

    def __init__(self, handlers: Mapping[str, grpc.RpcMethodHandler], interceptors: Sequence, methods,
                 max_message_bytes: int) -> None:
        self.handlers = {m: handlers[m] for m in methods}
        self.interceptors, self.max_message_bytes = tuple(interceptors), max_message_bytes
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task] = set()
        self.port = 0
        self._strangers, self._next_stranger_log = 0, 0.0  # connections that did not greet, and when to log one

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        """Stop listening and close every connection (their calls still running are cancelled)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=1.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self._connections.add(task)
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peername = writer.get_extra_info("peername")
        peer = f"lane:{peername[0]}:{peername[1]}" if isinstance(peername, tuple) else "lane"
        calls: set[asyncio.Task] = set()
        try:
            if await asyncio.wait_for(reader.readexactly(len(MAGIC)), GREETING_S) != MAGIC:
                self._strangers += 1  # (a port scanner's every probe logged a WARNING, QA)
                if time.monotonic() >= self._next_stranger_log:
                    self._next_stranger_log = time.monotonic() + STRANGER_LOG_S
                    log.warning("verify lane: %s did not open with the lane's greeting; closed (%d such connections "
                                "so far; logged once a minute at most)", peer, self._strangers)
                return
            writer.write(MAGIC)
            while True:
                header = await reader.readexactly(HEADER.size)
                call_id, kind, len1, len2 = HEADER.unpack(header)
                if kind != CALL or len1 > MAX_HEAD_BYTES or len2 > self.max_message_bytes:
                    why = (f"frame kind {kind} is not a call" if kind != CALL else
                           f"a call of {len1} + {len2} bytes is over the limits ({MAX_HEAD_BYTES} + "
                           f"{self.max_message_bytes})")
                    writer.write(status_frame(call_id, grpc.StatusCode.RESOURCE_EXHAUSTED if kind == CALL else
                                              grpc.StatusCode.INVALID_ARGUMENT, why + "; connection closed"))
                    log.warning("verify lane: %s: %s; connection closed", peer, why)
                    return
                head, body = await reader.readexactly(len1), await reader.readexactly(len2)
                call = asyncio.ensure_future(self._call(call_id, head, body, peer, writer))
                calls.add(call)
                call.add_done_callback(calls.discard)
                if len(calls) >= MAX_CALLS_PER_CONNECTION:  # the next frame waits: a client's calls are bounded
                    await asyncio.wait(set(calls), return_when=asyncio.FIRST_COMPLETED)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the client closed the connection (or never greeted)
        except asyncio.CancelledError:
            pass  # `stop` (ended here: asyncio logs a connection task that ends cancelled as an error)
        finally:
            for call in list(calls):
                call.cancel()  # as a gRPC client leaving cancels its calls
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self._connections.discard(task)

    async def _call(self, call_id: int, head: bytes, body: bytes, peer: str, writer: asyncio.StreamWriter) -> None:
        try:
            out = await self._run(call_id, head, body, peer)
            if not writer.is_closing():
                writer.write(out)
                # a client that does not read its replies holds this call (and, past MAX_CALLS_PER_CONNECTION, the
                # reading of its next frame): before, the replies piled up in the target's memory (QA: +800 MiB)
                await writer.drain()
        except (asyncio.CancelledError, ConnectionError):
            return  # the connection closed: nobody to answer

    async def _run(self, call_id: int, head_bytes: bytes, body: bytes, peer: str) -> bytes:
        try:
            head = decode_head(head_bytes)
        except ValueError as exc:  # (UnicodeDecodeError included)
            return status_frame(call_id, grpc.StatusCode.INVALID_ARGUMENT, f"malformed call head: {exc}")
        registered = self.handlers.get(head.method)
        if registered is None:
            return status_frame(call_id, grpc.StatusCode.UNIMPLEMENTED,
                                f"method {head.method[:200]} is not served on the verify lane")
        context = LaneContext(head.metadata, head.timeout_s, peer)
        deadline = None
        if head.timeout_s is not None:
            deadline = asyncio.get_running_loop().call_later(head.timeout_s, asyncio.current_task().cancel)
        try:
            handler = await self._handler(head.method, head.metadata, registered)
            if handler is None:
                return status_frame(call_id, grpc.StatusCode.UNIMPLEMENTED, f"method {head.method} not found")
            try:
                request = handler.request_deserializer(body) if handler.request_deserializer else body
            except Exception as exc:  # (the decode guard's deserializer never raises; grpc's own would)
                return status_frame(call_id, grpc.StatusCode.INVALID_ARGUMENT, f"the request does not parse: {exc}")
            response = await handler.unary_unary(request, context)
        except _Abort:
            response = None
        except asyncio.CancelledError:
            if deadline is None or context.time_remaining() > 0:
                raise
            return status_frame(call_id, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except Exception as exc:
            code, details = status_for(exc)
            return status_frame(call_id, code, details)
        finally:
            if deadline is not None:
                deadline.cancel()
        code = context.code()
        if code is not None and code is not grpc.StatusCode.OK:
            return status_frame(call_id, code, context.details() or "")
        if response is None:
            return status_frame(call_id, grpc.StatusCode.INTERNAL, "the handler returned no response")
        data = handler.response_serializer(response) if handler.response_serializer else response
        return frame(call_id, REPLY, b"", data)

    async def _handler(self, method: str, metadata, registered):
        """The handler the interceptor chain makes of `registered` for this call (as grpc's server does)."""
        details = _Details(method, metadata)

        async def run(index: int, call_details):
            if index == len(self.interceptors):
                return registered
            return await self.interceptors[index].intercept_service(lambda d: run(index + 1, d), call_details)

        return await run(0, details)
