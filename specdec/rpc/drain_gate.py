"""Refuse new calls once a server drains: every call but a health check gets UNAVAILABLE from the moment its
`ServerHandle.stop` begins.

`grpc.aio.Server.stop` refuses new calls itself, but only once it runs: the health flip to NOT_SERVING comes
first (so load balancers stop routing) and awaits, and a call that arrived in between was accepted, then
cancelled when the grace period ended (CANCELLED where a client retries only UNAVAILABLE; seen once under load
in `tests/reliability/test_reliability_drain.py`). Calls accepted before the drain run on for the grace period.
"""

from __future__ import annotations

import grpc
import grpc.aio

HEALTH_PREFIX = "/grpc.health.v1.Health/"


class DrainGate(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self.draining = False

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if not self.draining or handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        return _refusing(handler)


async def _refuse(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")


async def _refuse_stream(request, context):
    await _refuse(request, context)
    yield  # pragma: no cover - abort raises first; this makes it an async generator, as a streaming handler is


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind and (de)serializers as `handler` that answers UNAVAILABLE at once."""
    kind = (handler.request_streaming, handler.response_streaming)
    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    behaviour = _refuse_stream if handler.response_streaming else _refuse
    return make[kind](behaviour, request_deserializer=handler.request_deserializer,
                      response_serializer=handler.response_serializer)
