"""What a gRPC round trip costs when the server's handler takes a while: a bare echo (no specdec code), a 6 KB
reply, the handler returning at once or after `--work-ms` (a target's forward). Server kinds: the aio server on
uvloop (as the services run), the same with the work on another thread (the engine thread's hop), and the sync
server. Prints the round trip minus the work, median of `--calls`.

    python bench/idle_rtt.py [--work-ms 0,17] [--calls 150]

At batch 1 a Verify's "rest" (round trip minus the target's queue, forward and reply phases) was 1.4-1.7 ms on
both this CPU and the H200 host; this separates what gRPC itself costs after an idle wait from specdec's layers.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import grpc
import grpc.aio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.rpc.options import channel_options, server_options  # noqa: E402

REPLY = bytes(6000)
KINDS = ("aio-uvloop", "aio-uvloop-thread-hop", "sync")


def _serve(kind: str, work_s: float, port_out) -> None:
    pool = cf.ThreadPoolExecutor(1)

    def work(*_):
        if work_s:
            time.sleep(work_s)
        return REPLY

    async def handler(request, context):
        return await asyncio.get_running_loop().run_in_executor(pool, work) if "hop" in kind else work()

    def add(server, fn) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(fn)}),))

    if kind == "sync":
        server = grpc.server(cf.ThreadPoolExecutor(4), options=server_options())
        add(server, work)
        port_out.put(server.add_insecure_port("127.0.0.1:0"))
        server.start()
        server.wait_for_termination()
        return
    import uvloop

    async def main():
        server = grpc.aio.server(options=server_options())
        add(server, handler)
        port_out.put(server.add_insecure_port("127.0.0.1:0"))
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
        channel = grpc.insecure_channel(f"127.0.0.1:{port_out.get(timeout=30)}", options=channel_options())
        echo = channel.unary_unary("/bench.Echo/Echo")
        for _ in range(10):
            echo(b"x")
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            echo(b"x")
            times.append(time.perf_counter() - t0)
        channel.close()
        return 1e3 * statistics.median(times) - work_ms
    finally:
        proc.terminate()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-ms", default="0,17")
    ap.add_argument("--calls", type=int, default=150)
    args = ap.parse_args(argv)
    for kind in KINDS:
        for work_ms in (float(x) for x in args.work_ms.split(",")):
            print(f"{kind:22s} work {work_ms:5.1f} ms: round trip - work {measure(kind, work_ms, args.calls):.3f} ms",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
