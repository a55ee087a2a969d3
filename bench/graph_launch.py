"""What launching a CUDA graph costs the host, and whether the GPU waits for it (issue 6), on a GPU.

    python bench/graph_launch.py [--kernels 50,150,300] [--segments 1,2,4] [--out graph_launch.json]

A batch-1 verify of the 8B shape replays one graph of ~290 kernels, and its call measured ~0.2 ms more than the
graph's replay, its logits and the host work before the launch and after the sync together (`step_breakdown`,
sessions 17-19); `torch.cuda.CUDAGraph.replay` itself held the host ~0.28 ms a call there (cProfile). If the GPU
runs nothing of a graph until its launch returns, that time is added to every step that starts on an idle GPU
(each verify, each plain call's first step), and splitting the forward into segments would let the GPU start on
the first while the host launches the rest.

Here synthetic graphs of `--kernels` small kernels (in-place adds on a 1 MB tensor, ~2-3 us each) are captured whole
and in `--segments` pieces. For each: the host time of the replay calls alone (no sync), the GPU time of a replay
when replays run back to back (launches hidden behind the previous replay's work), and the wall time of one replay
from an idle GPU to its end (what a step pays). idle - back_to_back is what starting from idle costs; if it tracks
the launch's host time, the GPU waited for the launch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def capture(kernels: int, segments: int, x: torch.Tensor) -> list[torch.cuda.CUDAGraph]:
    """`kernels` in-place adds on x, captured as `segments` graphs of equal length (one memory pool)."""
    per = -(-kernels // segments)
    stream = torch.cuda.Stream()
    graphs, pool = [], None
    with torch.cuda.stream(stream):
        for _ in range(3):
            x.add_(1.0)
    torch.cuda.synchronize()
    for s in range(segments):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream, pool=pool):
            for _ in range(min(per, kernels - s * per)):
                x.add_(1.0)
        pool = g.pool()
        graphs.append(g)
    return graphs


def replay(graphs) -> None:
    for g in graphs:
        g.replay()


def measure(graphs, repeats: int) -> dict:
    replay(graphs)
    torch.cuda.synchronize()
    host = []  # the launches' host time, each from an idle GPU
    idle = []  # launch to the end of the replay, from an idle GPU
    for _ in range(repeats):
        torch.cuda.synchronize()
        time.sleep(0.002)  # the GPU idles, as between two verify calls
        t0 = time.perf_counter()
        replay(graphs)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        idle.append(t2 - t0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        replay(graphs)
    end.record()
    torch.cuda.synchronize()
    back_to_back = start.elapsed_time(end) / 1e3 / repeats
    ms = lambda xs: round(1e3 * statistics.median(xs), 4)  # noqa: E731
    row = {"launch_host_ms": ms(host), "idle_to_end_ms": ms(idle), "back_to_back_ms": round(1e3 * back_to_back, 4)}
    row["idle_cost_ms"] = round(row["idle_to_end_ms"] - row["back_to_back_ms"], 4)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", default="50,150,300")
    ap.add_argument("--segments", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default="graph_launch.json")
    args = ap.parse_args()
    x = torch.zeros(1 << 18, device="cuda")  # 1 MB: each add is a few microseconds
    rows = []
    for kernels in (int(k) for k in args.kernels.split(",")):
        for segments in (int(s) for s in args.segments.split(",")):
            row = {"kernels": kernels, "segments": segments, **measure(capture(kernels, segments, x), args.repeats)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
