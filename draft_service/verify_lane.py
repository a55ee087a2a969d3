"""Which verify lane (`specdec.rpc.lane`) a draft's Verify calls take, if any: the one its target tells of in
GetModelInfo (`verify_lane_port`), at the host of the target's address, over plaintext only.

A lane that cannot be connected to (a firewall, a Kubernetes Service without the lane's port) is not tried again
for `RETRY_S`: the calls go over gRPC meanwhile, as they do with no lane. A lane whose connection breaks with a
call under way fails that call like a target gone away (UNAVAILABLE), as gRPC would.
"""

from __future__ import annotations

import logging
import threading
import time

from specdec.rpc.lane_client import LaneClient, LaneDown
from specdec.rpc.options import DEFAULT_MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

RETRY_S = 60.0  # a lane that could not be connected to is tried again after this long


def lane_host(addr: str) -> str | None:
    """The host of a target address `host:port` / `[v6]:port`; None for other forms (`unix:`, `dns:///`...)."""
    if "/" in addr or addr.startswith("unix:"):
        return None
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class VerifyLane:
    def __init__(self, addr: str, plaintext: bool, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.host = lane_host(addr) if plaintext else None
        self.max_message_bytes = max_message_bytes
        self.client: LaneClient | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()

    def told(self, port: int) -> None:
        """The target's GetModelInfo says its lane listens at `port` (0: it has none)."""
        with self._lock:
            current = self.client
            if self.host is None or (current is not None and current.port == port):
                return
            self.client = LaneClient(self.host, port, self.max_message_bytes) if port else None
            self._down_until = 0.0
        if current is not None:
            current.close()
        if port:
            log.info("Verify calls go over the target's verify lane at %s:%d", self.host, port)

    def for_call(self) -> LaneClient | None:
        """The lane, connected for this thread, or None (no lane, or one that could not be connected to lately)."""
        client = self.client
        if client is None or time.monotonic() < self._down_until:
            return None
        try:
            client.connect()
        except LaneDown as exc:
            self._down_until = time.monotonic() + RETRY_S
            log.warning("%s; Verify calls go over gRPC, the lane is tried again in %.0f s (a Kubernetes Service must "
                        "expose the target's lane port too)", exc, RETRY_S)
            return None
        return client

    def reset(self) -> None:
        """Close the lane's connections (calls waiting on them end UNAVAILABLE); the next call opens new ones."""
        with self._lock:
            current = self.client
            if current is not None:
                self.client = LaneClient(current.host, current.port, self.max_message_bytes)
        if current is not None:
            current.close()

    def close(self) -> None:
        with self._lock:
            current, self.client = self.client, None
        if current is not None:
            current.close()
