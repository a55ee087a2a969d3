"""Client channels with the same message limits, keepalive and TLS as `start_server`, and a readiness wait.

Usage in a service's client module:

    channel = make_channel("target:50051", tls)
    await wait_for_serving(channel, "specdec.v1.TargetService", timeout_s=600)
    stub = target_pb2_grpc.TargetServiceStub(channel)
"""

from __future__ import annotations

import asyncio
import time

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import NotReady
from specdec.rpc.options import DEFAULT_MAX_MESSAGE_BYTES, channel_options
from specdec.rpc.tls import TlsConfig


def make_channel(
    addr: str,
    tls: TlsConfig | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors=None,
    credentials: grpc.ChannelCredentials | None = None,
) -> grpc.aio.Channel:
    """An aio channel to `addr` ("host:port"); plaintext without `tls` or `credentials` (already read from `tls`'s
    files). Close with `await channel.close()`.

    interceptors: client interceptors, e.g. `specdec.telemetry.grpc_tracing.client_interceptors()`."""
    options = channel_options(max_message_bytes)
    interceptors = list(interceptors) if interceptors else None
    if credentials is None and tls is not None:
        credentials = tls.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(addr, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(addr, credentials, options=options, interceptors=interceptors)


async def wait_for_serving(
    channel: grpc.aio.Channel, service_name: str = "", timeout_s: float = 60.0, poll_s: float = 0.2
) -> None:
    """Poll `grpc.health.v1` until `service_name` reports SERVING; raise NotReady after timeout_s.

    Connection failures, NOT_SERVING and unknown names all count as "not yet".
    """
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=service_name)
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            name = service_name or "(overall)"
            raise NotReady(f"service {name} not SERVING after {timeout_s:g} s ({last})")
        try:
            reply = await stub.Check(request, timeout=max(min(remaining, 5.0), 0.05))
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.aio.AioRpcError as exc:
            last = f"{exc.code().name}: {exc.details()}"
        await asyncio.sleep(min(poll_s, max(deadline - time.monotonic(), 0)))
