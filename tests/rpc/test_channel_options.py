"""The options every specdec channel gets (gateway -> services, draft -> target, the Python client)."""

from __future__ import annotations

from specdec.rpc.options import MAX_RECONNECT_BACKOFF_MS, channel_options


def test_reconnect_attempts_stay_frequent_after_a_long_outage():
    """gRPC's default backoff doubles up to 120 s, so a part back after minutes away was seen only at the next
    attempt (a QA run: 82 s after a target answered again, following a 3.5-minute outage). The wait is capped at
    2 s; the effect itself needs minutes of outage to show and is not timed here."""
    options = dict(channel_options())
    assert options["grpc.max_reconnect_backoff_ms"] == MAX_RECONNECT_BACKOFF_MS == 2000
    assert options["grpc.initial_reconnect_backoff_ms"] <= MAX_RECONNECT_BACKOFF_MS
