"""Refuse new calls while a server drains, and count the calls still running so the drain knows when it is done.

From the moment `ServerHandle.stop` begins, every call but a health check gets UNAVAILABLE (a status clients and
load balancers retry elsewhere). The server itself keeps running through the grace period: `grpc.aio.Server.stop`
refuses new calls too, but a call that reaches the core after it starts is never matched to a handler and is
cancelled (CANCELLED, which clients do not retry; seen under load in
`tests/reliability/test_reliability_drain.py`). So `stop` waits here for the calls in flight to end (or the grace
to run out) before it stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect

import grpc
import grpc.aio

from specdec.rpc.handlers import behaviour_of, rebuilt

HEALTH_PREFIX = "/grpc.health.v1.Health/"


# id(context) -> the drain's message, for the calls `end_running` ends (`ended_by_drain`)
_ENDED: dict[int, str] = {}


def ended_by_drain(context) -> bool:
    """Whether a drain's end is what stopped this call (for the status the access log and spans record)."""
    return id(context) in _ENDED


class _Call:
    """A counted call: its context, its task, and whether that task is in the handler's own code (not sending a
    response)."""

    __slots__ = ("context", "task", "in_handler")

    def __init__(self, context) -> None:
        self.context, self.task = context, asyncio.current_task()
        self.in_handler = True


class DrainGate(grpc.aio.ServerInterceptor):
    """`still_served`: full method names (`/pkg.Service/Method`) that keep being served while draining: the calls
    that let work already begun finish (the target's Verify and Release for the requests its drafts hold)."""

    def __init__(self, still_served: frozenset[str] = frozenset()) -> None:
        self.still_served = still_served
        self.draining = False
        self.in_flight = 0  # calls accepted and not yet ended (health checks not counted)
        self._idle = asyncio.Event()
        self._idle.set()
        self._calls: set[_Call] = set()
        self._ended: str | None = None  # `end_running`'s message, once the grace has run out

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        if self.draining and handler_call_details.method not in self.still_served:
            return rebuilt(handler, _refuse_stream if handler.response_streaming else _refuse)
        return rebuilt(handler, self._counted(behaviour_of(handler)))

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no counted call is running; False if `timeout_s` ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout_s, 0.0))
        except TimeoutError:
            return False
        return True

    def end_running(self, message: str) -> None:
        """The grace has run out: end every counted call with UNAVAILABLE and `message` (a client reads why and
        retries elsewhere; a stopping grpc server would cancel them with its own "Cancelling all calls"). A call in
        its handler's code is cancelled there; a stream sending a response ends before it reads the next one (a
        cancel at the send would reach grpc's code, which closes the stream without a status of ours)."""
        self._ended = message
        for call in list(self._calls):
            _ENDED[id(call.context)] = message
            if call.in_handler:
                call.task.cancel()

    def _counted(self, behaviour):
        """`behaviour`, counted while it runs, of the same kind (see `specdec.rpc.handlers.around`)."""
        if inspect.isasyncgenfunction(behaviour):
            async def stream(request, context):
                with self._counting(context) as call:
                    async with self._ending(context), contextlib.aclosing(behaviour(request, context)) as responses:
                        while True:
                            if self._ended is not None:
                                await context.abort(grpc.StatusCode.UNAVAILABLE, self._ended)
                            call.in_handler = True
                            try:
                                response = await anext(responses)
                            except StopAsyncIteration:
                                return
                            finally:
                                call.in_handler = False
                            yield response
            return stream

        async def unary(request, context):
            with self._counting(context):
                async with self._ending(context):
                    result = behaviour(request, context)
                    return await result if inspect.isawaitable(result) else result
        return unary

    @contextlib.contextmanager
    def _counting(self, context):
        call = _Call(context)
        self.in_flight += 1
        self._idle.clear()
        self._calls.add(call)
        try:
            yield call
        finally:
            self._calls.discard(call)
            _ENDED.pop(id(context), None)
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def _ending(self, context):
        """A cancel from `end_running` becomes the call's UNAVAILABLE with the drain's message."""
        try:
            yield
        except asyncio.CancelledError:
            if self._ended is None:  # the client left, or its deadline passed
                raise
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._ended)


async def _refuse(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")


async def _refuse_stream(request, context):
    await _refuse(request, context)
    yield  # pragma: no cover - abort raises first; this makes it an async generator, as a streaming handler is
