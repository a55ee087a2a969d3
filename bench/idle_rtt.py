"""What a gRPC round trip costs when the server's handler takes a while: a bare echo (no specdec code), a 6 KB
reply, the handler returning at once or after `--work-ms` (a target's forward). Server kinds: the aio server on
uvloop (as the services run), the same with the work on another thread (the engine thread's hop), and the sync
server. Prints the round trip minus the work as the server measured it (the reply's first 8 bytes: an earlier
version subtracted the nominal sleep and counted its overshoot, ~0.1 ms, as gRPC's), median of `--calls`; and the
same for a bare TCP socket echo (no gRPC) and for a wake-up of one thread by another (the hand-offs inside a
service).

    python bench/idle_rtt.py [--work-ms 0,17] [--calls 150]

At batch 1 a Verify's "rest" (round trip minus the target's queue, forward and reply phases) was 1.4-1.7 ms on
both the 2-core CPU and the H200 host; this separates what gRPC itself costs after an idle wait from specdec's
layers. The H200 host (a VM, session 14): aio 0.64 ms at once / 0.94 after 6 ms of work, with the thread hop 0.77 /
1.19, TCP socket 0.02 / 0.12, a thread's wake-up 0.010 / 0.064 ms: a sleeping thread costs ~60 us to wake there,
and a gRPC round trip wakes several.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import multiprocessing as mp
import os
import queue
import socket
import statistics
import struct
import sys
import threading
import time
from pathlib import Path

import grpc
import grpc.aio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.rpc.options import channel_options, server_options  # noqa: E402

REPLY = bytes(6000)
CALLS_WARMUP = 10
# verify-lane: specdec's verify lane (`specdec.rpc.lane_server` on uvloop, the work on another thread, a blocking
# `LaneClient`), what a draft's Verify takes when its target serves one
KINDS = ("aio-uvloop", "aio-uvloop-thread-hop", "sync", "aio-uvloop-unix", "aio-uvloop-stream", "verify-lane")


def _serve(kind: str, work_s: float, port_out) -> None:
    pool = cf.ThreadPoolExecutor(1)

    def work(*_):
        t0 = time.perf_counter()
        if work_s:
            time.sleep(work_s)
        return struct.pack("d", time.perf_counter() - t0) + REPLY

    async def handler(request, context):
        hop = "hop" in kind or kind == "verify-lane"
        return await asyncio.get_running_loop().run_in_executor(pool, work) if hop else work()

    async def stream_handler(requests, context):
        async for _ in requests:
            yield work()

    def add(server, fn) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(fn),
                           "Stream": grpc.stream_stream_rpc_method_handler(stream_handler)}),))

    if kind == "sync":
        server = grpc.server(cf.ThreadPoolExecutor(4), options=server_options())
        add(server, work)
        port_out.put(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        server.wait_for_termination()
        return
    import uvloop

    async def main():
        if kind == "verify-lane":
            from specdec.rpc.lane_server import LaneServer

            lane = LaneServer({"/bench.Echo/Echo": grpc.unary_unary_rpc_method_handler(handler)}, [],
                              ["/bench.Echo/Echo"], 1 << 26)
            port_out.put(f"lane:{await lane.start('127.0.0.1', 0)}")
            await asyncio.Event().wait()
        server = grpc.aio.server(options=server_options())
        add(server, handler)
        if kind.endswith("unix"):
            path = f"/tmp/idle_rtt_{os.getpid()}.sock"
            server.add_insecure_port(f"unix:{path}")
            port_out.put(f"unix:{path}")
        else:
            port_out.put(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        await server.start()
        await server.wait_for_termination()

    uvloop.install()
    asyncio.run(main())


def measure(kind: str, work_ms: float, calls: int) -> float:
    """Median round trip minus the handler's work, in ms."""
    port_out = mp.Queue()
    proc = mp.Process(target=_serve, args=(kind, work_ms / 1e3, port_out), daemon=True)
    proc.start()
    try:
        addr = port_out.get(timeout=30)
        if kind == "verify-lane":
            from specdec.rpc.lane_client import LaneClient

            lane = LaneClient("127.0.0.1", int(addr.split(":")[1]), 1 << 26)
            channel = lane  # (closed below)
            echo = lambda message: lane.call("/bench.Echo/Echo", message, 10.0)  # noqa: E731
        else:
            channel = grpc.insecure_channel(addr, options=channel_options())
            echo = _stream_echo(channel) if kind.endswith("stream") else channel.unary_unary("/bench.Echo/Echo")
        for _ in range(CALLS_WARMUP):
            echo(b"x")
        rests = []
        for _ in range(calls):
            t0 = time.perf_counter()
            reply = echo(b"x")
            rests.append(time.perf_counter() - t0 - struct.unpack("d", reply[:8])[0])
        channel.close()
        return 1e3 * statistics.median(rests)
    finally:
        proc.terminate()


def _stream_echo(channel):
    """A call per message over one bidirectional stream (requests fed from a queue, as a blocking client would)."""
    requests: queue.Queue = queue.Queue()
    replies = channel.stream_stream("/bench.Echo/Stream")(iter(requests.get, None))

    def echo(message: bytes) -> bytes:
        requests.put(message)
        return next(replies)

    return echo


def _socket_serve(work_s: float, port_out) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_out.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while conn.recv(64):
        t0 = time.perf_counter()
        if work_s:
            time.sleep(work_s)
        conn.sendall(struct.pack("d", time.perf_counter() - t0) + REPLY)


def measure_socket(work_ms: float, calls: int) -> float:
    """The same echo over a bare TCP socket (no gRPC, no event loop): what the network stack itself costs."""
    port_out = mp.Queue()
    proc = mp.Process(target=_socket_serve, args=(work_ms / 1e3, port_out), daemon=True)
    proc.start()
    try:
        conn = socket.create_connection(("127.0.0.1", port_out.get(timeout=30)))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rests = []
        for i in range(CALLS_WARMUP + calls):
            t0 = time.perf_counter()
            conn.sendall(b"x")
            data = b""
            while len(data) < 8 + len(REPLY):
                data += conn.recv(1 << 16)
            if i >= CALLS_WARMUP:
                rests.append(time.perf_counter() - t0 - struct.unpack("d", data[:8])[0])
        conn.close()
        return 1e3 * statistics.median(rests)
    finally:
        proc.terminate()


def measure_wakeup(work_ms: float, calls: int) -> float:
    """One thread waking another through a condition after `work_ms` idle (ms from notify to running)."""
    cond, box, delays = threading.Condition(), [], []

    def waiter():
        for _ in range(CALLS_WARMUP + calls):
            with cond:
                while not box:
                    cond.wait()
                delays.append(time.perf_counter() - box.pop())

    thread = threading.Thread(target=waiter)
    thread.start()
    for _ in range(CALLS_WARMUP + calls):
        if work_ms:
            time.sleep(work_ms / 1e3)
        with cond:
            box.append(time.perf_counter())
            cond.notify()
        while box:
            time.sleep(0)
    thread.join()
    return 1e3 * statistics.median(delays[CALLS_WARMUP:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-ms", default="0,17")
    ap.add_argument("--calls", type=int, default=150)
    args = ap.parse_args(argv)
    for work_ms in (float(x) for x in args.work_ms.split(",")):
        for kind in KINDS:
            print(f"{kind:22s} work {work_ms:5.1f} ms: round trip - work {measure(kind, work_ms, args.calls):.3f} ms",
                  flush=True)
        sock = measure_socket(work_ms, args.calls)
        print(f"{'tcp socket':22s} work {work_ms:5.1f} ms: round trip - work {sock:.3f} ms")
        wake = measure_wakeup(work_ms, args.calls)
        print(f"{'thread wake-up':22s} after {work_ms:5.1f} ms: {wake:.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
