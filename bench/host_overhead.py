"""Host (Python) work of one TargetEngine.verify step, with the model and attention stubbed out, so only the
engine's own bookkeeping is timed: page tables, tree masks, positions, acceptance, KV compaction, commits.

    python bench/host_overhead.py --batch-size 128 --context 1024 [--graphs]

On a GPU this time is spent while the GPU waits (the step's kernels are launched after it), so it bounds how fast
a large batch can step. Runs on CPU; the tiny pair's config gives the shapes. `--graphs`: the path a GPU takes with
CUDA graphs (`TargetGraphs`' host work: the flashinfer plan's page tables and input copies, the planner and the
replay stubbed), else the eager path.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.engine.factory import EngineOptions, build_target  # noqa: E402
from specdec.engine.requests import PrefillInput, VerifyInput  # noqa: E402
from specdec.models.llama import TargetOutput  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402


class NoAttention:
    def plan(self, batch):
        return batch


class NoPlan:
    is_cuda_graph_enabled = False  # (a captured wrapper's mask buffer is written in place: none here)
    device = torch.device("cpu")

    def plan(self, *args, **kwargs) -> None:
        pass


class NoReplay:
    def replay(self) -> None:
        pass


def stub_graphs(target, b: int, shapes: list[tuple[int, bool]]):
    """TargetGraphs whose graphs are captured for `shapes` ((tokens per request, causal)) at batch b, on the CPU:
    their plans go to a planner that keeps nothing and their replays do nothing, the rest is the real host code."""
    from specdec.attention.graph_backend import GraphAttention
    from specdec.engine import cuda_graphs

    torch.cuda.device = lambda _device: contextlib.nullcontext()  # CPU stand-in for the graphs' device scope
    graphs = cuda_graphs.TargetGraphs.__new__(cuda_graphs.TargetGraphs)
    graphs.model, graphs.kv, graphs.failed, graphs.graphs = target.model, target.kv, set(), {}
    graphs.decode_graphs = {}  # flashinfer's path only
    graphs.scratch_pages = target.kv.set_aside(2)
    graphs.ladder = tuple(x for x in cuda_graphs.BATCH_LADDER if x <= b) or (1,)
    for n, causal in shapes:
        bucket = next(x for x in cuda_graphs.ladder_for(graphs.ladder, n) if x >= b)
        attn = GraphAttention.__new__(GraphAttention)
        attn.kv, attn.num_qo_heads, attn.n, attn.causal = target.kv, target.cfg.num_heads, n, causal
        attn.wrapper = NoPlan()
        attn.write_slots = torch.zeros(bucket * n, dtype=torch.int64)
        zeros = torch.zeros(bucket * n, dtype=torch.int64)
        graphs.graphs[(bucket, n, (), causal)] = cuda_graphs._Graph(
            NoReplay(), attn, zeros, zeros.clone(), torch.zeros(bucket * n, target.cfg.hidden_size), None)
    return graphs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--graphs", action="store_true", help="the CUDA-graph path's host work (stubbed planner)")
    args = ap.parse_args()
    b, ctx = args.batch_size, args.context
    pages = b * (-(-(ctx + 1100) // 16) + 2)
    target = build_target(str(ROOT / "models" / "tiny-code" / "target"),
                          EngineOptions(num_pages=pages, max_batch_size=b))
    params = SamplingParams(max_new_tokens=1000, ignore_eos=True)
    target.prefill([PrefillInput(f"r{i}", list(range(100, 100 + ctx)), params) for i in range(b)])
    hidden = target.cfg.hidden_size
    target.backend = NoAttention()
    target.model.forward = lambda ids, *a, **k: TargetOutput(torch.zeros(ids.shape[0], hidden), None)
    target.model.compute_logits = lambda h: torch.zeros(h.shape[0], 8)
    if args.graphs:
        target.graphs = stub_graphs(target, b, [(1, True), (7, True), (17, False)])
    for label, tokens, parents, more in (
            ("plain decode", [], [], {}), ("chain of 6", [5] * 6, list(range(-1, 5)), {}),
            ("tree of 16 (topk 4)", [5] * 16, [-1] * 4 + [i // 4 for i in range(12)], {}),
            # what the draft asks for while `auto` decodes plainly: 4 steps, each request's last feature row
            ("4 plain steps, last feature row", [], [], {"plain_steps": 4, "feature_rows": 1})):
        inputs = [VerifyInput(f"r{i}", tokens, parents) for i in range(b)]
        target.verify(inputs, **more)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            target.verify(inputs, **more)  # zero logits: nothing accepted, one token committed per request and step
            times.append(time.perf_counter() - t0)
        times.sort()
        print(f"{label}: {times[0] * 1e3:.2f} ms host per verify step, median {times[len(times) // 2] * 1e3:.2f} "
              f"(batch {b}, context {ctx}{', graphs' if args.graphs else ''})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
