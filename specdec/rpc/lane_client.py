"""The client end of the verify lane (`specdec.rpc.lane`), for blocking callers (the draft's engine threads).

One connection per calling thread, opened at its first call; calls sent one after another from a thread reach the
server in that order (what pipelined plain calls need of the target). A call can be sent (`start`) and its reply
collected later (`LaneCall.result`), from any thread: replies that arrive for other calls of the connection are
kept for them.

Errors are `LaneStatus` (a `grpc.RpcError`): the server's status for the call, DEADLINE_EXCEEDED when no reply
came within the timeout, UNAVAILABLE when the connection broke with the call sent (the target went away; the call
may or may not have run, as with gRPC). A connection that cannot be opened raises `LaneDown` before anything was
sent: the caller may send that call over gRPC instead.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

import grpc

from specdec.rpc.lane import (
    CALL,
    HEADER,
    MAGIC,
    MAX_HEAD_BYTES,
    REPLY,
    STATUS,
    LaneStatus,
    encode_head,
    frame,
    status_from,
)

CONNECT_TIMEOUT_S = 1.0  # a peer on the same network answers in well under a millisecond


class LaneDown(ConnectionError):
    """No connection to the lane could be opened (nothing was sent)."""


class _Connection:
    def __init__(self, host: str, port: int, max_message_bytes: int) -> None:
        try:
            self.sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.sendall(MAGIC)
            if _read(self.sock, len(MAGIC)) != MAGIC:
                raise LaneDown(f"{host}:{port} does not answer as a verify lane")
        except OSError as exc:
            self.close()
            raise LaneDown(f"no verify lane at {host}:{port}: {exc}") from None
        self.max_message_bytes = max_message_bytes
        self.next_id = 0
        self.send_lock, self.recv_lock = threading.Lock(), threading.Lock()
        self.arrived: dict[int, bytes | LaneStatus] = {}  # replies read for calls not yet collected
        self.broken: str | None = None

    def close(self) -> None:
        sock = getattr(self, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked reading it
            sock.close()


class LaneCall:
    """A call sent on the lane; `result()` waits for its reply (bytes) or raises its LaneStatus."""

    def __init__(self, client: LaneClient, conn: _Connection, call_id: int, deadline: float) -> None:
        self._client, self._conn, self._id, self._deadline = client, conn, call_id, deadline

    def result(self) -> bytes:
        return self._client._collect(self._conn, self._id, self._deadline)


class LaneClient:
    def __init__(self, host: str, port: int, max_message_bytes: int) -> None:
        self.host, self.port, self.max_message_bytes = host, port, max_message_bytes
        self._local = threading.local()
        self._all: set[_Connection] = set()
        self._lock = threading.Lock()
        self.closed = False

    def call(self, method: str, body: bytes, timeout_s: float, metadata=()) -> bytes:
        return self.start(method, body, timeout_s, metadata).result()

    def start(self, method: str, body: bytes, timeout_s: float, metadata=()) -> LaneCall:
        """Send a call without waiting for its reply. LaneDown: no connection (nothing sent)."""
        conn = self.connect()
        head = encode_head(method, timeout_s, metadata)
        if len(head) > MAX_HEAD_BYTES:
            raise LaneStatus(grpc.StatusCode.INVALID_ARGUMENT, f"call metadata of {len(head)} bytes")
        with conn.send_lock:
            call_id = conn.next_id = (conn.next_id + 1) & 0xFFFFFFFF
            try:
                conn.sock.settimeout(timeout_s)
                conn.sock.sendall(frame(call_id, CALL, head, body))
            except OSError as exc:
                self._break(conn, f"the verify lane's connection broke while sending: {exc}")
                raise LaneStatus(grpc.StatusCode.UNAVAILABLE, conn.broken) from None
        return LaneCall(self, conn, call_id, time.monotonic() + timeout_s)

    def close(self) -> None:
        """Close every connection: calls waiting on them end UNAVAILABLE (any thread)."""
        self.closed = True
        with self._lock:
            conns, self._all = list(self._all), set()
        for conn in conns:
            self._break(conn, "the verify lane was closed")

    def connect(self) -> _Connection:
        """This thread's connection, opened now if it has none (or its last one broke). LaneDown: none could be."""
        conn = getattr(self._local, "conn", None)
        if conn is not None and conn.broken is None and _open(conn.sock):
            return conn
        if conn is not None:  # the target closed it (restarted, or stopped with no call under way): a new one
            self._break(conn, conn.broken or "the target closed the verify lane's connection")
        if self.closed:
            raise LaneDown("the verify lane was closed")
        conn = _Connection(self.host, self.port, self.max_message_bytes)
        with self._lock:
            self._all.add(conn)
        self._local.conn = conn
        return conn

    def _break(self, conn: _Connection, why: str) -> None:
        if conn.broken is None:
            conn.broken = why
        conn.close()
        with self._lock:
            self._all.discard(conn)

    def _collect(self, conn: _Connection, call_id: int, deadline: float) -> bytes:
        with conn.recv_lock:
            while call_id not in conn.arrived:
                if conn.broken is not None:
                    raise LaneStatus(grpc.StatusCode.UNAVAILABLE, conn.broken)
                left = deadline - time.monotonic()
                if left <= 0:
                    self._break(conn, "an earlier call on this connection timed out")  # its late reply would come
                    raise LaneStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                try:
                    conn.sock.settimeout(left)
                    got_id, answer = self._read_reply(conn)
                except TimeoutError:  # (perhaps within a frame: the connection cannot be read further)
                    self._break(conn, "an earlier call on this connection timed out")
                    raise LaneStatus(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
                except (OSError, ValueError) as exc:
                    self._break(conn, f"the target closed the verify lane's connection ({exc or 'end of stream'})")
                    continue
                conn.arrived[got_id] = answer
            answer = conn.arrived.pop(call_id)
        if isinstance(answer, LaneStatus):
            raise answer
        return answer

    @staticmethod
    def _read_reply(conn: _Connection) -> tuple[int, bytes | LaneStatus]:
        call_id, kind, len1, len2 = HEADER.unpack(_read(conn.sock, HEADER.size))
        if kind not in (REPLY, STATUS) or len1 > MAX_HEAD_BYTES or len2 > conn.max_message_bytes:
            raise ValueError(f"a frame of kind {kind} and {len1} + {len2} bytes is no reply")
        part1, part2 = _read(conn.sock, len1), _read(conn.sock, len2)
        return call_id, (part2 if kind == REPLY else status_from(part1, part2))


def _open(sock: socket.socket) -> bool:
    """Whether the peer has not closed the connection (its end of stream or a reset is waiting to be read), asked
    without blocking before a call is sent on it: a call sent on a connection a restarted target closed while this
    thread was idle reached nobody, and failed UNAVAILABLE as if that target were away."""
    try:
        poller = select.poll()  # (a recv with MSG_DONTWAIT waits out the socket's timeout in Python)
        poller.register(sock, select.POLLIN)
        if not poller.poll(0):
            return True  # nothing to read: open
        return sock.recv(1, socket.MSG_PEEK) != b""  # a reply waiting (open), or the end of the stream
    except (OSError, ValueError):
        return False


def _read(sock: socket.socket, n: int) -> bytes:
    """Exactly n bytes; ConnectionError at the end of the stream."""
    if n == 0:
        return b""
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("end of stream")
        chunks.append(chunk)
        left -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
