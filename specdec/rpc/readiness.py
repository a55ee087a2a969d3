"""Answer UNAVAILABLE on every RPC but health and reflection until the service's model is loaded.

The server starts (and health reports NOT_SERVING) before the weights are read, so probes and clients get a
clear "loading" instead of a refused connection; `gate.open()` lets calls through once the engine is up.
"""

from __future__ import annotations

import grpc
import grpc.aio

ALWAYS_OPEN = ("/grpc.health.", "/grpc.reflection.")


class ReadinessGate(grpc.aio.ServerInterceptor):
    def __init__(self, service: str):
        self.service = service
        self.reason = f"{service} is starting (loading its model, warming up)"
        self.is_open = False

    def open(self) -> None:
        self.is_open = True

    def close(self, reason: str) -> None:
        self.is_open, self.reason = False, reason

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if self.is_open or handler is None or details.method.startswith(ALWAYS_OPEN):
            return handler
        reason = self.reason

        async def unary(request, context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, reason)

        async def streaming(request, context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, reason)
            yield  # pragma: no cover - makes this an async generator

        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(streaming, **kw)
        return handler
