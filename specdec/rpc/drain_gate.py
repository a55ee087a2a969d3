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
import time

import grpc
import grpc.aio

from specdec.rpc.handlers import around, behaviour_of, rebuilt

HEALTH_PREFIX = "/grpc.health.v1.Health/"


# the ids of the contexts of the calls `end_running` ended and that still run -> the message they end with
_ENDED: dict[int, str] = {}


def ended_by_drain(context) -> bool:
    """Whether a drain's end is what stopped this call (for the status the access log and spans record)."""
    return drain_message(context) is not None


def drain_message(context) -> str | None:
    """The message a call a drain's end stopped goes with (its client's UNAVAILABLE), for wrappers that see only its
    cancel (the gateway's access log read it from the context, which the gate sets later, QA)."""
    return _ENDED.get(id(context))


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
        self._idle = asyncio.Event()
        self._idle.set()
        self._calls: set[_Call] = set()  # the calls accepted and not yet ended (health checks not counted)
        self._ended: str | None = None  # `end_running`'s message, once the grace has run out
        self._last_call = -float("inf")  # when the last call (health checks not counted) arrived, monotonic

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        self._last_call = time.monotonic()
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

    async def wait_quiet(self, quiet_s: float, timeout_s: float) -> None:
        """Until no call has arrived for `quiet_s` (at once if none came that recently), `timeout_s` at most. Clients
        that go elsewhere once refused (UNAVAILABLE) or once health says NOT_SERVING stop calling within a round
        trip; a grpc server stopped while their calls still arrive cancels those it has not yet handed to a handler
        (CANCELLED, which clients do not retry: 6-7 of 8 such clients, each one call, stopped at once)."""
        end = time.monotonic() + max(timeout_s, 0.0)
        while (wait := min(self._last_call + quiet_s, end) - time.monotonic()) > 0:
            await asyncio.sleep(wait)

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
        """`behaviour`, counted while it runs (`_running`), of the same kind. A stream's task is in grpc's code while
        it sends a response: `in_handler` tells `end_running` whether a cancel would reach the handler."""
        if not inspect.isasyncgenfunction(behaviour):
            return around(behaviour, lambda request, context: self._running(context))

        async def stream(request, context):
            async with self._running(context) as call, contextlib.aclosing(behaviour(request, context)) as responses:
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

    @contextlib.asynccontextmanager
    async def _running(self, context):
        """A call counted while it runs; a cancel from `end_running` becomes its UNAVAILABLE with the drain's
        message."""
        call = _Call(context)
        self._calls.add(call)
        self._idle.clear()
        try:
            yield call
        except asyncio.CancelledError:
            if self._ended is None:  # the client left, or its deadline passed
                raise
            try:
                await context.abort(grpc.StatusCode.UNAVAILABLE, self._ended)
            except grpc.aio.UsageError:  # cancelled within the handler's own abort: its status stands (QA, once:
                raise asyncio.CancelledError from None  # "Abort already called!" logged with a traceback)
        finally:
            self._calls.discard(call)
            _ENDED.pop(id(context), None)
            if not self._calls:
                self._idle.set()


async def _refuse(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")


async def _refuse_stream(request, context):
    await _refuse(request, context)
    yield  # pragma: no cover - abort raises first; this makes it an async generator, as a streaming handler is
