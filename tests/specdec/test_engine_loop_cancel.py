"""A stream whose caller leaves while its request is still being added (a client's cancel or deadline a few
milliseconds in) must not leave the request running on the engine: it would hold its pages and its id, and no
one would read it."""

from __future__ import annotations

import asyncio
import threading

from specdec.engine.scheduler import Event
from specdec.sampling_params import SamplingParams
from specdec.serving.engine_loop import EngineLoop


class FakeScheduler:
    """Records adds and aborts; an aborted request finishes with "abort" at the next step."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        self.running: set[str] = set()
        self.aborted: set[str] = set()

    def add(self, request_id, prompt_ids, sampling, trace_context=None, tree_cap=None) -> None:
        self.log.append(("add", request_id))
        self.running.add(request_id)

    def abort(self, request_id: str) -> None:
        self.log.append(("abort", request_id))
        self.aborted.add(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.aborted)

    def step(self) -> list[Event]:
        done, self.aborted = self.aborted, set()
        self.running -= done
        return [Event(rid, [], "abort") for rid in done]

    def close(self) -> None:
        pass


def test_a_caller_cancelled_while_its_request_is_added_aborts_it():
    async def body():
        sched = FakeScheduler()
        loop = EngineLoop(sched)
        loop.start()
        gate = threading.Event()
        busy = asyncio.ensure_future(loop.call(gate.wait))  # the engine thread is inside another call
        await asyncio.sleep(0.05)

        async def read():
            async for _ in loop.stream("r1", [1, 2, 3], SamplingParams()):
                pass

        task = asyncio.ensure_future(read())
        await asyncio.sleep(0.05)  # the add is queued behind the busy call
        task.cancel()
        await asyncio.sleep(0.05)
        gate.set()
        await busy
        for _ in range(100):
            if not sched.running and ("abort", "r1") in sched.log:
                break
            await asyncio.sleep(0.01)
        assert sched.log == [("add", "r1"), ("abort", "r1")] and not sched.running
        await asyncio.wait([task], timeout=5)  # its abort call's answer comes back through the event loop
        assert task.cancelled()
        # the id is free again: a new stream under it is added and, left early too, aborted
        again = asyncio.ensure_future(read())
        await asyncio.sleep(0.05)
        again.cancel()
        for _ in range(100):
            if sched.log[-1] == ("abort", "r1") and len(sched.log) == 4:
                break
            await asyncio.sleep(0.01)
        assert sched.log[2:] == [("add", "r1"), ("abort", "r1")]
        loop.stop()

    asyncio.run(body())


def test_an_abort_after_a_refused_duplicate_leaves_the_running_request_alone():
    async def body():
        sched = FakeScheduler()
        loop = EngineLoop(sched)
        loop.start()
        first = loop.stream("r1", [1], SamplingParams())
        reader = asyncio.ensure_future(first.__anext__())  # adds r1, waits for its first event
        await asyncio.sleep(0.05)
        gate = threading.Event()
        busy = asyncio.ensure_future(loop.call(gate.wait))
        await asyncio.sleep(0.05)

        async def duplicate():
            async for _ in loop.stream("r1", [1], SamplingParams()):
                pass

        dup = asyncio.ensure_future(duplicate())
        await asyncio.sleep(0.05)
        dup.cancel()  # its add will be refused (r1 runs); the abort queued behind it must not touch r1
        gate.set()
        await busy
        await asyncio.sleep(0.1)
        assert sched.log == [("add", "r1")] and sched.running == {"r1"}
        reader.cancel()
        loop.stop()

    asyncio.run(body())
