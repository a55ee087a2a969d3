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

import grpc

from specdec.rpc.lane_client import LaneClient, LaneDown
from specdec.rpc.options import DEFAULT_MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

RETRY_S = 60.0  # a lane that could not be connected to is tried again after this long
MISSES_DOWN = 2  # probes in a row the lane did not answer (while gRPC did) before its calls move to gRPC
PROBE = b""  # an empty VerifyRequest: the target answers it at once, with nothing run


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
        self._misses = 0

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

    def retry_now(self) -> None:
        """The target answers again after it did not (restarted, back from a pause): a lane it refused meanwhile
        was refused by a target away, not by a network that lacks the lane's port, so it is tried at the next call
        (QA: a draft whose step found a draining target's lane closed left the lane for 60 s, with a WARNING about
        a Kubernetes Service, and a target restarted on the same lane port was told of it in vain meanwhile)."""
        self._down_until = 0.0

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
        if self._down_until:
            self._down_until = 0.0
            log.info("Verify calls go over the target's verify lane at %s:%d again", client.host, client.port)
        return client

    def probe(self, method: str, timeout_s: float) -> None:
        """One empty call on the lane (the target watch's, after its target answered over gRPC). A lane that does
        not answer `MISSES_DOWN` probes in a row while gRPC does (its port cut off alone, a frozen proxy) is left
        for `RETRY_S` and its calls under way end UNAVAILABLE (their requests fail over, as when gRPC is cut off):
        before, they waited out their 60 s deadline (QA)."""
        client = self.for_call()
        if client is None:
            return
        try:
            client.call(method, PROBE, timeout_s)
        except (grpc.RpcError, LaneDown) as exc:
            if isinstance(exc, grpc.RpcError) and exc.code() not in (grpc.StatusCode.UNAVAILABLE,
                                                                     grpc.StatusCode.DEADLINE_EXCEEDED):
                self._misses = 0  # it answered (refused while loading or draining: the lane works)
                return
            self._misses += 1
            if self._misses >= MISSES_DOWN:
                self._misses = 0
                self._down_until = time.monotonic() + RETRY_S
                log.warning("the verify lane at %s:%d does not answer while the target's gRPC port does (%s); "
                            "Verify calls go over gRPC, the lane is tried again in %.0f s", client.host, client.port,
                            exc, RETRY_S)
                self.reset()
            return
        self._misses = 0

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
