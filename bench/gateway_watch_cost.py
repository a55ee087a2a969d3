"""What watching a stream's parts costs the gateway per chunk (CPU, no services): `gateway.fallback._unless_hung`
over an in-memory stream of N chunks, against iterating the same stream bare. A chunk is one request's tokens of
one step, so at 128 requests and ~100 steps a second the gateway passes ~13k chunks a second.

    python bench/gateway_watch_cost.py [--chunks 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.fallback import _unless_hung  # noqa: E402
from gateway.router import Part  # noqa: E402


async def _chunks(n: int):
    for i in range(n):
        yield i


async def _per_chunk_us(n: int, watched: bool) -> float:
    stream = _chunks(n)
    if watched:
        stream = _unless_hung(stream, {Part.DRAFT: asyncio.Event(), Part.TARGET: asyncio.Event()})
    t0 = time.perf_counter()
    async for _ in stream:
        pass
    return (time.perf_counter() - t0) / n * 1e6


async def main(args) -> None:
    for r in range(args.rounds):
        bare = await _per_chunk_us(args.chunks, watched=False)
        watched = await _per_chunk_us(args.chunks, watched=True)
        print(f"round {r}: per chunk bare {bare:.2f} us, watched {watched:.2f} us")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    try:
        import uvloop

        uvloop.run(main(parser.parse_args()))
    except ImportError:
        asyncio.run(main(parser.parse_args()))
