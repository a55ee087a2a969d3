"""One thread owns an engine; asyncio handlers talk to it through calls, batched calls and event streams.

The thread alternates between (1) running the calls that arrived (calls that share a batch function run as one
batch: several Verify RPCs become one target forward) and (2) one scheduler step when the scheduler has work.
Events of a step are handed to the asyncio queue of their request. Handlers never touch the engine directly, so
health checks and new requests are served while a step runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.engine.device import resolve_device
from specdec.engine.requests import RUNNING
from specdec.engine.scheduler import Event, Scheduler
from specdec.errors import DuplicateRequest, NotReady, SpecdecError
from specdec.sampling_params import SamplingParams
from specdec.telemetry.tracing import current_trace_context
from specdec.tree import TreeCap

log = logging.getLogger(__name__)

# A request under an id that a running stream holds waits up to this long for that stream to leave before it is
# refused ALREADY_EXISTS: a client that cancels a stream and reuses its id at once reaches this service through the
# gateway as two separate calls, and the new one may arrive before the old one's cancel (QA: 2-6 of 30 reuses after
# a cancel a few messages in were refused, on the speculative path)
DUPLICATE_GRACE_S = 1.0


@dataclass
class _Call:
    fn: Callable
    args: tuple
    future: asyncio.Future
    batch_fn: Callable | None = None  # when set: fn is None and args[0] is the batch item
    weight: int = 0  # a batch item's share of its batch's cap (`call_batched`)
    cap: int = 0


@dataclass
class _Stream:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    events: list = field(default_factory=list)
    leaving: bool = False  # aborted: its id is free once the scheduler has applied the abort


class EngineLoop:
    def __init__(self, scheduler: Scheduler | None, name: str = "engine", device=None,
                 lock: AbstractContextManager | None = None):
        self.scheduler = scheduler
        self.name = name
        self.device = resolve_device(device) if device is not None else None  # the engine's GPU, if any
        # held while this thread works on the engine (calls, chore, step): an engine that another thread also
        # drives takes turns with it (a draft service's in-process target, `draft_service.colocated`)
        self._engine_lock = lock if lock is not None else contextlib.nullcontext()
        self._calls: list[_Call] = []
        self._streams: dict[str, _Stream] = {}
        # id -> `_add_stream`'s arguments (request_id, prompt_ids, sampling, stream, trace_context, tree_cap) of the
        # request that takes the id once the leaving stream holding it has ended
        self._next: dict[str, tuple] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.on_step: Callable[[list[Event]], None] | None = None  # metrics hook, runs on the engine thread
        # called on the event loop when a stream leaves before its request finished, before its abort is queued:
        # thread-safe work only (the draft cancels the request's Prefill RPC if its admission is under way, which
        # holds the engine thread, so the abort would wait for it: `TargetClient.cancel_prefill`)
        self.on_leave: Callable[[str], None] | None = None
        if scheduler is not None:  # a request's first token reaches its stream before the step's decode
            scheduler.before_decode = self._hand_out
        # a chore run on the engine thread between calls every `chore_every_s`, idle or not (None: none)
        self.chore: Callable[[], None] | None = None
        self.chore_every_s = 5.0
        # when the thread began the work under way (its calls, chore and step of one round; waiting for the engine
        # lock included), None while it waits for work: `busy_s`
        self._busy_since: float | None = None
        self._queued_since: float | None = None  # when the oldest call the thread has not taken yet arrived

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop after the step under way; -> whether the thread ended within `timeout_s` (False: it is still in a
        step, e.g. a call to a slow target: what that step uses must not be closed under it)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def busy_s(self) -> float:
        """Seconds the engine thread has been in its current round of work, or has left a call it was handed
        untaken (0.0 while it waits for work and none is queued): a round that lasts far longer than any step
        should is a thread held by a hung kernel, a deadlock, a stuck call; calls left untaken, a thread stuck
        between rounds (`specdec.serving.stall_watch`). Any thread may ask."""
        oldest = min((t for t in (self._busy_since, self._queued_since) if t is not None), default=None)
        return 0.0 if oldest is None else max(time.monotonic() - oldest, 0.0)

    @property
    def thread_id(self) -> int | None:
        """The engine thread's id (None before `start`)."""
        return self._thread.ident

    @property
    def stopping(self) -> bool:
        """`stop` was asked (a long call on the engine thread, start-up calibration, checks it to end early)."""
        return self._stopping

    # ---- asyncio side -------------------------------------------------------------------------------------
    async def call(self, fn: Callable, *args) -> Any:
        """Run fn(*args) on the engine thread between steps."""
        return await self._submit(_Call(fn, args, asyncio.get_running_loop().create_future()))

    async def call_batched(self, batch_fn: Callable[[list], list], item, weight: int = 0, cap: int = 0) -> Any:
        """Queue `item`; items queued together run as one `batch_fn(items) -> results`. If the batch raises a
        SpecdecError, each item is retried alone so only the bad one fails; a result that is an exception is
        raised to its caller alone. `cap` (0: none): a round of the thread takes items, in order, while their
        `weight`s sum to at most `cap` (the first always); the rest wait for the next round, so the calls and the
        step that came meanwhile run in between (the target's Prefill RPCs: their prompt tokens)."""
        fut = asyncio.get_running_loop().create_future()
        return await self._submit(_Call(None, (item,), fut, batch_fn, weight, cap))

    async def _submit(self, call: _Call) -> Any:
        with self._cond:
            if self._stopping:
                raise NotReady(f"{self.name} is shutting down")
            if not self._calls:
                self._queued_since = time.monotonic()
            self._calls.append(call)
            self._cond.notify()
        return await call.future

    async def stream(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams,
                     tree_cap: TreeCap | None = None) -> AsyncIterator[Event]:
        """Add a request to the scheduler and yield its events until it finishes; leaving early aborts it.
        `tree_cap`: the request's own smaller tree shape (`Scheduler.add`)."""
        loop = asyncio.get_running_loop()
        s = _Stream(asyncio.Queue(), loop)
        # the caller's trace (contextvars do not reach the engine thread): parents the request's spans there
        adding = asyncio.ensure_future(
            self.call(self._add_stream, request_id, prompt_ids, sampling, s, current_trace_context(), tree_cap))
        adding.add_done_callback(lambda t: t.cancelled() or t.exception())  # read, even when no one awaits it
        try:
            held = await asyncio.shield(adding)
        except asyncio.CancelledError:
            # the caller left (a client's cancel, a deadline) while the add was queued: the engine thread adds the
            # request all the same, so this stream's abort is queued right behind it (calls run in order), and the
            # request does not run on, holding its pages and its id, with no one reading it
            self._left(request_id, s)
            await self._abort(request_id, s)
            raise
        finished = False
        # waiting for the id of a stream that has not left: refused once the grace has passed and it still holds it
        refuse = loop.call_later(DUPLICATE_GRACE_S, self._refuse_later, request_id, s) if held else None
        try:
            while True:
                ev: Event = await s.queue.get()
                if ev.error is not None:
                    finished = True
                    raise ev.error
                yield ev
                if ev.finish_reason != RUNNING:
                    finished = True
                    return
        finally:
            if refuse is not None:
                refuse.cancel()
            if not finished:
                self._left(request_id, s)
                await self._abort(request_id, s)

    async def _abort(self, request_id: str, stream: _Stream) -> None:
        """Abort a stream's request on the engine thread, unless the loop is stopping (nothing runs there any more:
        before, the abort's NotReady escaped the closing stream, an ERROR "Task exception was never retrieved"
        traceback a stream a drain cut: QA)."""
        with contextlib.suppress(NotReady):
            await asyncio.shield(self.call(self._abort_stream, request_id, stream))

    def _refuse_later(self, request_id: str, stream: _Stream) -> None:
        task = asyncio.ensure_future(self.call(self._refuse_held, request_id, stream))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (NotReady while stopping: nothing to do)

    @property
    def _left_ids(self) -> set[str] | None:
        """The scheduler's ids whose clients have left (`Scheduler.left`; None: a scheduler that keeps none)."""
        return getattr(self.scheduler, "left", None)

    def _left(self, request_id: str, stream: _Stream) -> None:
        # its admission skips it from now on (its abort call comes after); not a stream still waiting for the id of
        # another, which runs under that id meanwhile
        if self._left_ids is not None and self._streams.get(request_id) is stream:
            self._left_ids.add(request_id)
        if self.on_leave is not None:
            try:
                self.on_leave(request_id)
            except Exception:  # noqa: BLE001 - the abort still goes
                log.exception("on_leave hook failed")

    def _add_stream(self, request_id, prompt_ids, sampling, stream: _Stream, trace_context=None,
                    tree_cap: TreeCap | None = None) -> bool:
        """-> True when the request waits for the id of a stream that has not left (yet): `_refuse_held` ends
        the wait after DUPLICATE_GRACE_S."""
        old = self._streams.get(request_id)
        if old is not None:
            # an id a client cancelled is free at the next step's start (the scheduler applies aborts there, and
            # releases the target's state): a client that reuses it at once waits for that, not ALREADY_EXISTS;
            # so does a request that came before the old stream's cancel did (DUPLICATE_GRACE_S)
            if request_id in self._next:  # another request waits for the id already
                raise _duplicate(request_id)
            self._next[request_id] = (request_id, prompt_ids, sampling, stream, trace_context, tree_cap)
            return not old.leaving
        self.scheduler.add(request_id, prompt_ids, sampling, trace_context, tree_cap)  # may refuse it: then no stream
        self._streams[request_id] = stream
        return False

    def _refuse_held(self, request_id: str, stream: _Stream) -> None:
        """The grace of a request waiting for a held id has passed: refused if the stream holding the id has not
        left meanwhile (a second request under a running id), else it keeps waiting for that stream's end."""
        waiting, old = self._next.get(request_id), self._streams.get(request_id)
        if waiting is None or waiting[3] is not stream or old is None or old.leaving:
            return
        del self._next[request_id]
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait,
                                         Event(request_id, [], "abort", error=_duplicate(request_id)))

    def _take_over(self, request_id: str) -> None:
        """The id's stream has ended: the request waiting for the id is added now (its error, if refused, ends
        its stream)."""
        args = self._next.pop(request_id, None)
        if args is None:
            return
        stream = args[3]
        try:
            self._add_stream(*args)
        except Exception as exc:  # noqa: BLE001 - handed to its stream, which raises it in the handler
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait,
                                             Event(request_id, [], "abort", error=_as_specdec(exc)))

    def _abort_stream(self, request_id: str, stream: _Stream | None = None) -> bool:
        """Abort the request (only if `stream` is the one it runs under, when given: not a request that took
        the id after, nor the one whose id a refused duplicate asked for)."""
        if self._left_ids is not None:
            self._left_ids.discard(request_id)  # the abort takes over (a request that reuses the id runs)
        waiting = self._next.get(request_id)
        if waiting is not None and stream is not None and waiting[3] is stream:  # left before it got the id
            del self._next[request_id]
            return True
        found = request_id in self._streams and (stream is None or self._streams[request_id] is stream)
        if found:
            self._streams[request_id].leaving = True
            self.scheduler.abort(request_id)
        return found

    async def abort(self, request_id: str) -> bool:
        return await self.call(self._abort_stream, request_id)

    # ---- engine thread ------------------------------------------------------------------------------------
    def _main(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            # CUDA's current device is per thread: graph capture, Triton and flashinfer launch on it
            torch.cuda.set_device(self.device)
        chore_at = time.monotonic() + self.chore_every_s
        while True:
            with self._cond:
                while not self._calls and not self._stopping and not (self.scheduler and self.scheduler.has_work):
                    if self.chore is None:
                        self._cond.wait()
                    elif not self._cond.wait(max(chore_at - time.monotonic(), 0.0)):
                        break  # the chore's time came
                stopping = self._stopping
                if stopping:
                    self._fail_all()
                calls, self._calls = self._calls, []
                # the round counts from the oldest call it takes (no gap in `busy_s` between queue and round)
                self._busy_since, self._queued_since = self._queued_since or time.monotonic(), None
            if stopping:  # verifies in flight are waited for outside the lock: handlers keep being answered
                self._busy_since = None
                if self.scheduler is not None:
                    self.scheduler.close()
                return
            try:
                with self._engine_lock:
                    self._run_calls(calls)
                    if self.chore is not None and time.monotonic() >= chore_at:
                        self._resolve_chore()
                        chore_at = time.monotonic() + self.chore_every_s
                    if self.scheduler is not None and self.scheduler.has_work:
                        self._step()
            finally:
                self._busy_since = None

    def _resolve_chore(self) -> None:
        try:
            self.chore()
        except Exception:  # noqa: BLE001 - a chore's failure is logged; the engine goes on
            log.exception("%s chore failed", self.name)

    def _run_calls(self, calls: list[_Call]) -> None:
        batches: dict[Callable, list[_Call]] = {}
        for c in calls:
            if c.batch_fn is None:
                self._resolve(c, lambda c=c: c.fn(*c.args))
            else:
                batches.setdefault(c.batch_fn, []).append(c)
        for batch_fn, group in batches.items():
            # a caller that left while its item waited (a cancelled RPC: its handler's future is cancelled) is not
            # run: a draft's Prefill of a request its client cancelled during admission once ran anyway, seconds of
            # prompt forwards on a slow device, while requests behind it waited (QA)
            group = self._capped([c for c in group if not c.future.cancelled()])
            if not group:
                continue
            try:
                results = batch_fn([c.args[0] for c in group])
            except SpecdecError:
                for c in group:  # isolate the failing item
                    self._resolve(c, lambda c=c, fn=batch_fn: fn([c.args[0]])[0])
                continue
            except Exception as exc:  # noqa: BLE001 - reported to every caller of the batch
                for c in group:
                    self._set(c.future, exc=exc)
                continue
            for c, r in zip(group, results, strict=True):
                if isinstance(r, BaseException):
                    self._set(c.future, exc=r)
                else:
                    self._set(c.future, result=r)

    def _capped(self, group: list[_Call]) -> list[_Call]:
        """The batch's items this round takes under its cap; the others go back to the head of the queue."""
        if not group or not group[0].cap:
            return group
        n, weight = 1, group[0].weight
        while n < len(group) and weight + group[n].weight <= group[0].cap:
            weight += group[n].weight
            n += 1
        if n < len(group):
            with self._cond:
                self._calls[:0] = group[n:]
                self._queued_since = self._queued_since or time.monotonic()
        return group[:n]

    def _resolve(self, call: _Call, thunk: Callable) -> None:
        try:
            self._set(call.future, result=thunk())
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting handler, which maps it to a status
            self._set(call.future, exc=exc)

    @staticmethod
    def _set(fut: asyncio.Future, result=None, exc: BaseException | None = None) -> None:
        def apply():
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        fut.get_loop().call_soon_threadsafe(apply)

    def _step(self) -> None:
        try:
            events = self.scheduler.step()
        except Exception as exc:  # noqa: BLE001 - a broken step fails its requests, not the service
            log.exception("%s step failed", self.name)
            events = self.scheduler.fail_running(_as_specdec(exc))
        if self.on_step is not None:
            try:
                self.on_step(events)
            except Exception:  # noqa: BLE001
                log.exception("on_step hook failed")
        self._hand_out(events)

    def _hand_out(self, events: list[Event]) -> None:
        """Hand events to their streams (engine thread): after a step, and a step's admissions before its decode
        (`Scheduler.before_decode`)."""
        deliveries: dict[asyncio.AbstractEventLoop, list] = {}  # one wake-up per event loop, not per request
        for ev in events:
            stream = self._streams.get(ev.request_id)
            if stream is None:
                continue
            if ev.finish_reason != RUNNING or ev.error is not None:
                del self._streams[ev.request_id]
                self._take_over(ev.request_id)
            deliveries.setdefault(stream.loop, []).append((stream.queue, ev))
        for loop, items in deliveries.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _fail_all(self) -> None:
        err = NotReady(f"{self.name} is shutting down")
        for c in self._calls:
            self._set(c.future, exc=err)
        self._calls = []
        waiting = [(rid, args[3]) for rid, args in self._next.items()]
        for rid, stream in [*self._streams.items(), *waiting]:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, Event(rid, [], "abort", error=err))
        self._streams.clear()
        self._next.clear()


def _deliver(items: list[tuple[asyncio.Queue, Event]]) -> None:
    for queue, ev in items:
        queue.put_nowait(ev)


def _duplicate(request_id: str) -> DuplicateRequest:
    return DuplicateRequest(f"request {request_id!r} is already running")


def _as_specdec(exc: Exception) -> SpecdecError:
    if isinstance(exc, SpecdecError):
        return exc
    err = SpecdecError(f"internal error: {type(exc).__name__}: {exc}")
    return err
