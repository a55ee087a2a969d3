"""What streaming the tokens costs a service's engine thread (CPU only, no model): the real DraftService handler,
engine loop and gRPC server, driven by a fake scheduler whose steps take a fixed time, half of it holding the
interpreter lock (host work: kernel launches, planning) and half not (waiting for the GPU); `--hold 1.0`: the whole
step holds it (a GPU wait that keeps the lock). Each step yields one
event per running request, which the service streams to its client (another process, so the client's own work
is not on this interpreter). Reported: the wall time of a step against the fake step's own time; the difference is
what the event loop's streaming took from the engine thread (the interpreter lock is shared).

    python bench/stream_cost.py [--requests 1,8,32,64,128] [--step-ms 10] [--steps 100] [--hold 0.5,1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.engine.requests import LENGTH, RUNNING  # noqa: E402
from specdec.engine.scheduler import Event  # noqa: E402


class FakeScheduler:
    """Each step: `hold_s` of Python work (holds the interpreter lock), then `wait_s` of sleep (releases it);
    5 tokens per running request; a request finishes after `steps` steps."""

    def __init__(self, hold_s: float, wait_s: float, steps: int):
        self.hold_s, self.wait_s, self.steps = hold_s, wait_s, steps
        self.running: dict[str, int] = {}
        self.step_times: list[float] = []

    def add(self, rid, prompt_ids, sampling, trace_context=None):
        self.running[rid] = 0

    def abort(self, rid):
        self.running.pop(rid, None)

    def close(self):
        pass

    @property
    def has_work(self) -> bool:
        return bool(self.running)

    def step(self) -> list[Event]:
        t0 = time.perf_counter()
        end = t0 + self.hold_s
        x = 0
        while time.perf_counter() < end:  # host work: holds the interpreter lock
            x += 1
        time.sleep(self.wait_s)  # the GPU: the lock is free
        events = []
        for rid in list(self.running):
            self.running[rid] += 1
            done = self.running[rid] >= self.steps
            events.append(Event(rid, [7, 8, 9, 10, 11], LENGTH if done else RUNNING, num_accepted_drafts=4,
                                from_verify=True, num_draft_tokens=5))
            if done:
                del self.running[rid]
        self.step_times.append(time.perf_counter() - t0)
        return events


def client(addr: str, n: int, result) -> None:
    from specdec.rpc.channel import make_channel
    from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

    async def one(stub, i):
        req = draft_pb2.DraftServiceGenerateRequest(request_id=f"r{i}", prompt_ids=[1, 2, 3],
                                                    sampling=common_pb2.SamplingParams(max_new_tokens=100000))
        k = 0
        async for msg in stub.Generate(req):
            k += len(msg.token_ids)
        return k

    async def main():
        async with make_channel(addr) as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(stub, i) for i in range(n)))
            result.put((time.perf_counter() - t0, sum(counts)))

    asyncio.run(main())


def measure(n: int, step_s: float, steps: int, hold: float = 0.5) -> dict:
    import grpc

    from draft_service.servicer import DraftServicer
    from specdec.rpc.options import server_options
    from specdec.serving.engine_loop import EngineLoop
    from specdec.v1 import draft_pb2_grpc

    sched = FakeScheduler(step_s * hold, step_s * (1 - hold), steps)
    loop = EngineLoop(sched, "draft-engine")
    servicer = DraftServicer("fake")
    servicer.loop, servicer.max_context, servicer.vocab_size = loop, 1 << 20, 1 << 20
    started, port, stop = threading.Event(), [0], []

    def serve():
        import uvloop

        async def main():
            server = grpc.aio.server(options=server_options())
            draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
            port[0] = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            stop.append((asyncio.get_running_loop(), asyncio.Event()))
            started.set()
            await stop[0][1].wait()
            await server.stop(0)

        uvloop.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    started.wait()
    loop.start()
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    proc = ctx.Process(target=client, args=(f"127.0.0.1:{port[0]}", n, result))
    t0 = time.thread_time()
    proc.start()
    wall, tokens = result.get(timeout=600)
    proc.join()
    cpu = time.thread_time() - t0
    aloop, ev = stop[0]
    aloop.call_soon_threadsafe(ev.set)
    thread.join(10)
    loop.stop()
    per_step = sorted(sched.step_times)[len(sched.step_times) // 2]
    return dict(requests=n, step_ms=1000 * step_s, fake_step_median_ms=1000 * per_step,
                wall_per_step_ms=1000 * wall / steps, overhead_per_step_ms=1000 * (wall / steps - step_s),
                tokens=tokens, bench_thread_cpu_s=cpu)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", default="1,8,32,64,128")
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--hold", default="0.5,1.0", help="fractions of a step that hold the interpreter lock")
    args = p.parse_args(argv)
    for hold in (float(x) for x in args.hold.split(",")):
        for n in (int(x) for x in args.requests.split(",")):
            row = dict(hold=hold, **measure(n, args.step_ms / 1000, args.steps, hold))
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
