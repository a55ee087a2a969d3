"""Channel and server options both ends share: message size limits, keepalive and reconnect backoff.

The client pings every 30 s (even when idle) and drops a connection whose ping is not answered in 10 s;
the server accepts pings that frequent. Both ends use the same message limit (256 MiB by default: a
Verify response carries the features of a whole batch).
"""

from __future__ import annotations

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000
# the longest wait between two attempts to reconnect to a peer that went away (gRPC's default doubles up to 120 s:
# a gateway noticed a target back 82 s after it answered, following a 3.5-minute outage)
MAX_RECONNECT_BACKOFF_MS = 2_000


def message_options(max_message_bytes: int, max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    """Explicit send and receive limits (gRPC's defaults are 4 MiB receive, unlimited send); `max_receive_bytes`:
    a lower receive limit (the gateway's: no valid request is larger)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_receive_bytes or max_message_bytes),
    ]


def server_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                   max_receive_bytes: int | None = None) -> list[tuple[str, int]]:
    """Options for `grpc.aio.server`: limits, keepalive, and no SO_REUSEPORT (one server per port)."""
    return [
        *message_options(max_message_bytes, max_receive_bytes),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options for `grpc.aio.*_channel`: limits, keepalive pings even between calls, and reconnect attempts at
    least every MAX_RECONNECT_BACKOFF_MS (a peer that comes back is used within a health check or two)."""
    return [
        *message_options(max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", 500),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]
