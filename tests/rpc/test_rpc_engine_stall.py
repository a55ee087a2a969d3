"""Health follows the engine's progress (`StallWatch`, `EngineLoop.busy_s`, `ServiceHealth`): a round of the engine
thread's work that lasts past the limit reports the service stalled, UNKNOWN under every name and calls refused
saying why; its end restores what the backend's watch says."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc.readiness import ReadinessGate
from specdec.rpc.server import LIVENESS, start_server
from specdec.rpc.service_health import ServiceHealth
from specdec.serving.engine_loop import EngineLoop
from specdec.serving.stall_watch import StallWatch

S = health_pb2.HealthCheckResponse


def test_busy_s_counts_the_round_under_way_and_is_zero_while_waiting():
    async def body():
        loop = EngineLoop(None, "test-engine")
        loop.start()
        try:
            assert loop.busy_s() == 0.0
            hold, entered = threading.Event(), threading.Event()
            held = asyncio.ensure_future(loop.call(lambda: (entered.set(), hold.wait(10))))
            await asyncio.to_thread(entered.wait, 5)
            await asyncio.sleep(0.3)
            during = loop.busy_s()
            hold.set()
            await held
            await asyncio.sleep(0.05)
            return during, loop.busy_s()
        finally:
            loop.stop()

    during, after = asyncio.run(body())
    assert 0.3 <= during < 5 and after == 0.0


def test_calls_left_untaken_count_as_busy():
    """A thread stuck between rounds (its calls queued, never taken) is as stalled as one stuck in a round."""
    async def body():
        loop = EngineLoop(None, "test-engine")  # not started: nothing takes its calls
        queued = asyncio.ensure_future(loop.call(lambda: None))
        await asyncio.sleep(0.3)
        busy = loop.busy_s()
        queued.cancel()
        return busy

    assert 0.3 <= asyncio.run(body()) < 5


def test_a_short_limit_is_warned_about(caplog):
    StallWatch(lambda: 0.0, 2.0, "the target's engine thread")
    StallWatch(lambda: 0.0, 30.0, "the target's engine thread")
    said = [r.getMessage() for r in caplog.records if "is short" in r.getMessage()]
    assert len(said) == 1 and "--engine-stall-seconds 2 is short" in said[0]


def test_a_stall_is_reported_once_when_it_begins_and_once_when_it_ends(caplog):
    busy = [0.0]
    reports = []

    async def report(reason):
        reports.append(reason)

    async def body():
        watch = StallWatch(lambda: busy[0], 2.0, "the target's engine thread")
        for value in (0.5, 1.9, 2.0, 7.0, 9.0, 0.0, 0.0, 3.0, 0.1):
            busy[0] = value
            await watch.look(report)
        return watch

    watch = asyncio.run(body())
    assert watch.stalls == 2 and not watch.stalled and watch.look_s == 0.5
    assert [r is None for r in reports] == [False, True, False, True]
    assert "one step for over 2 s (--engine-stall-seconds)" in reports[0]
    said = [r.getMessage() for r in caplog.records]
    assert sum("moves again after a step of at least 9.0 s" in m for m in said) == 1


def test_a_look_after_the_process_was_paused_is_skipped(caplog):
    """SIGSTOP for 40 s, then SIGCONT: the engine's round counts the pause, which is no stall (QA: an ERROR and a
    second of UNKNOWN). The late look is skipped; the next judges: nothing when the step has ended meanwhile, the
    stall when the round still goes on."""
    reports = []

    async def report(reason):
        reports.append(reason)

    async def body(after_pause: list[float]):
        now = [100.0]
        looks = [40.5]  # the first sleep spans the pause, the others take their time
        busy = list(after_pause)  # what each look reads (the last one again after)
        watch = StallWatch(lambda: busy.pop(0) if len(busy) > 1 else busy[0], 30.0, "the target's engine thread")
        watch.clock = lambda: now[0]
        real_sleep = asyncio.sleep

        async def sleep(s):
            now[0] += looks.pop(0) if looks else s
            await real_sleep(0)

        asyncio.sleep = sleep
        try:
            task = asyncio.ensure_future(watch.run(report))
            for _ in range(len(after_pause) + 3):
                await real_sleep(0)
            task.cancel()
        finally:
            asyncio.sleep = real_sleep
        return watch

    watch = asyncio.run(body([0.2]))  # the step ended just after the pause
    assert watch.pauses == 1 and watch.stalls == 0 and reports == []
    watch = asyncio.run(body([41.0, 42.0]))  # still in the same round: a stall all the same
    assert watch.pauses == 1 and watch.stalls == 1 and reports and reports[0] is not None


def test_health_and_calls_follow_the_stall_and_the_backend():
    """A backend away: own name and "" NOT_SERVING, liveness SERVING. Stalled: all UNKNOWN, a call refused with the
    reason. The stall over while the backend is still away: back to the backend's NOT_SERVING, calls let through."""
    own = "test.Service"

    async def body():
        gate = ReadinessGate(own)
        async def echo(request, context):
            return request

        methods = grpc.method_handlers_generic_handler(own, {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
        handle = await start_server([lambda s: s.add_generic_rpc_handlers((methods,))], [own, LIVENESS],
                                    "127.0.0.1", 0, interceptors=[gate])
        gate.open()
        health = ServiceHealth(handle, gate, ("", own))
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.bound_port}")
        stub = health_pb2_grpc.HealthStub(channel)

        async def statuses():
            return [(await stub.Check(health_pb2.HealthCheckRequest(service=n), timeout=5)).status
                    for n in ("", own, LIVENESS)]

        async def call_status():
            try:
                await channel.unary_unary(f"/{own}/Echo")(b"hi", timeout=5)
            except grpc.aio.AioRpcError as err:
                return err.code(), err.details()
            return grpc.StatusCode.OK, ""

        seen = {}
        try:
            await health.set_backend(True)
            seen["serving"] = await statuses()
            await health.set_backend(False)
            seen["backend away"] = await statuses()
            await health.set_stalled("the target's engine thread has been in one step for 31 s: it is stalled")
            seen["stalled"] = await statuses()
            seen["stalled call"] = await call_status()
            await health.set_stalled(None)
            seen["stall over"] = await statuses()
            seen["call"] = await call_status()
            await health.set_backend(True)
            seen["all well"] = await statuses()
        finally:
            await channel.close()
            await handle.stop(None)
        return seen

    seen = asyncio.run(body())
    assert seen["serving"] == seen["all well"] == [S.SERVING] * 3
    assert seen["backend away"] == seen["stall over"] == [S.NOT_SERVING, S.NOT_SERVING, S.SERVING]
    assert seen["stalled"] == [S.UNKNOWN] * 3
    assert seen["stalled call"][0] == grpc.StatusCode.UNAVAILABLE and "stalled" in seen["stalled call"][1]
    assert seen["call"][0] == grpc.StatusCode.OK


def test_a_real_service_reports_a_stuck_engine_and_recovers(tmp_path):
    """run_service with an engine whose thread is held in one call: UNKNOWN within the limit and a look, SERVING
    again once the call returns."""
    from specdec.rpc.service_runner import ServiceSpec, run_service

    hold, entered = threading.Event(), threading.Event()
    seen: dict[str, list[int]] = {}

    async def body():
        shutdown, ready_port = asyncio.Event(), asyncio.get_running_loop().create_future()
        engine = EngineLoop(None, "test-engine")
        engine.start()

        async def load(metrics):
            return "model"

        async def close():
            engine.stop()

        spec = ServiceSpec("t", "test.Service", [], load, close, "127.0.0.1", 0, None, drain_s=0.1,
                           engine_busy=engine.busy_s, stall_s=0.4)
        serving = asyncio.ensure_future(run_service(spec, shutdown, ready_port.set_result))
        port = await ready_port
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = health_pb2_grpc.HealthStub(channel)

        async def status():
            return (await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)).status

        async def wait(status_wanted, within_s):
            t0, log = time.monotonic(), []
            while (s := await status()) != status_wanted and time.monotonic() - t0 < within_s:
                log.append(s)
                await asyncio.sleep(0.05)
            return s, time.monotonic() - t0

        try:
            seen["before"] = [await status()]
            held = asyncio.ensure_future(engine.call(lambda: (entered.set(), hold.wait(20))))
            await asyncio.to_thread(entered.wait, 5)
            seen["stuck"] = list(await wait(S.UNKNOWN, 5))
            hold.set()
            await held
            seen["moving"] = list(await wait(S.SERVING, 5))
        finally:
            hold.set()
            await channel.close()
            shutdown.set()
            await serving
        return seen

    seen = asyncio.run(asyncio.wait_for(body(), 60))
    assert seen["before"] == [S.SERVING]
    assert seen["stuck"][0] == S.UNKNOWN and seen["stuck"][1] < 2.0, seen
    assert seen["moving"][0] == S.SERVING and seen["moving"][1] < 1.0, seen
