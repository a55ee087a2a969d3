"""The verify lane's frames: unary calls of a gRPC service over one plain TCP connection, without HTTP/2.

Why a lane at all: a draft calls its target's Verify once a step, waiting for each answer, and after the target's
~5-10 ms forward a gRPC round trip costs ~1-1.4 ms on the lent GPU hosts beyond its handler's work (grpc's own
threads waking one another; `bench/idle_rtt.py`, docs/benchmarks.md), against ~0.1-0.15 ms for the same bytes
over a bare TCP socket. The lane carries the same serialized requests and replies, and the server runs each call
through its gRPC handler and interceptors (drain gate, readiness, tracing, decode guard: `lane_server.py`), so a
call's outcome and status are what the gRPC call's would be.

A connection opens with `MAGIC` each way. Then every frame is a header (`HEADER`: call id, kind, then the lengths
of its two parts) followed by its two parts:
- CALL (client -> server): part 1 the call's head (UTF-8 lines: the full method name, the timeout in ms, then
  `key: value` metadata lines, e.g. `traceparent`), part 2 the serialized request;
- REPLY (server -> client): part 1 empty, part 2 the serialized response;
- STATUS (server -> client): part 1 the status code's number (ASCII), part 2 its details (UTF-8).
Replies may come in any order; the call id matches them. A frame that breaks these rules ends the connection.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import grpc

MAGIC = b"specdec-lane/1\n"
HEADER = struct.Struct("<IBII")  # call id, kind, part 1 length, part 2 length
CALL, REPLY, STATUS = 1, 2, 3
MAX_HEAD_BYTES = 64 * 1024  # a call's method, timeout and metadata
MAX_TIMEOUT_DIGITS = 12  # a call's timeout in ms: up to ~30 years
_CODES = {code.value[0]: code for code in grpc.StatusCode}


class LaneStatus(grpc.RpcError):
    """A lane call's status other than OK, read like a gRPC error (`code()`, `details()`): what the server's handler
    ended the call with, or UNAVAILABLE / DEADLINE_EXCEEDED for a connection that broke or a reply that did not come
    in time."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass(frozen=True)
class CallHead:
    method: str
    timeout_s: float | None
    metadata: tuple[tuple[str, str], ...]


def encode_head(method: str, timeout_s: float | None, metadata=()) -> bytes:
    lines = [method, str(max(1, round(timeout_s * 1000))) if timeout_s else "0"]  # (0: no deadline)
    lines += [f"{key}: {value}" for key, value in metadata]
    return "\n".join(lines).encode()


def decode_head(data: bytes) -> CallHead:
    """A CALL's head; ValueError when it is not one."""
    lines = data.decode().split("\n")
    if len(lines) < 2 or not lines[0].startswith("/"):
        raise ValueError("a call's head starts with its method and timeout")
    if not lines[1].isdigit() or len(lines[1]) > MAX_TIMEOUT_DIGITS:  # (400 digits overflowed a float, QA)
        raise ValueError(f"timeout {lines[1][:40]!r} is not a count of milliseconds of at most "
                         f"{MAX_TIMEOUT_DIGITS} digits")
    timeout_ms = int(lines[1])
    metadata = []
    for line in lines[2:]:
        key, sep, value = line.partition(": ")
        if not sep or not key:
            raise ValueError(f"metadata line {line[:60]!r} is not `key: value`")
        metadata.append((key, value))
    return CallHead(lines[0], timeout_ms / 1000 if timeout_ms else None, tuple(metadata))


def frame(call_id: int, kind: int, part1: bytes, part2: bytes) -> bytes:
    return HEADER.pack(call_id, kind, len(part1), len(part2)) + part1 + part2


def status_frame(call_id: int, code: grpc.StatusCode, details: str) -> bytes:
    return frame(call_id, STATUS, str(code.value[0]).encode(), details.encode(errors="replace"))


def status_from(part1: bytes, part2: bytes) -> LaneStatus:
    code = _CODES.get(int(part1.decode() or "2"), grpc.StatusCode.UNKNOWN)
    return LaneStatus(code, part2.decode(errors="replace"))
