"""A method handler rebuilt around another behaviour (or request deserializer), same kind and serializers.

Server interceptors that change what a call does (`drain_gate.py`, `decode_guard.py`) return a new handler:
grpc's handler is a named tuple with one behaviour slot per kind (unary / streaming request x response), and
the matching `grpc.*_rpc_method_handler` must build it so grpc runs it the way the original was run.

    handler = rebuilt(handler, around(behaviour_of(handler), scope))
"""

from __future__ import annotations

import contextlib
import inspect

import grpc

_MAKERS = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
           (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}


def behaviour_of(handler: grpc.RpcMethodHandler):
    """The function that runs the call: whichever of the handler's four behaviour slots its kind fills."""
    kind = (handler.request_streaming, handler.response_streaming)
    return {(False, False): handler.unary_unary, (False, True): handler.unary_stream,
            (True, False): handler.stream_unary, (True, True): handler.stream_stream}[kind]


def rebuilt(handler: grpc.RpcMethodHandler, behaviour, request_deserializer=None) -> grpc.RpcMethodHandler:
    """A handler of the same kind and response serializer as `handler` that runs `behaviour`; its request
    deserializer is `request_deserializer`, or `handler`'s own when None."""
    make = _MAKERS[(handler.request_streaming, handler.response_streaming)]
    return make(behaviour, request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer)


def around(behaviour, scope):
    """`behaviour` run inside `scope(request, context)` (an async context manager: a check that may abort before,
    a count kept during), of the same kind: an async generator stays one (its stream closed when the call ends),
    a coroutine function stays one."""
    if inspect.isasyncgenfunction(behaviour):
        async def stream(request, context):
            async with scope(request, context), contextlib.aclosing(behaviour(request, context)) as responses:
                async for response in responses:
                    yield response
        return stream

    async def call(request, context):
        async with scope(request, context):
            result = behaviour(request, context)
            return await result if inspect.isawaitable(result) else result
    return call
