"""Decode attention of the 8B shape (32 query / 8 KV heads, head_dim 128, bf16, pages of 16) as a captured causal
forward runs it (one query per request; `--queries n`: a chain verify's n causal queries): flashinfer's captured
prefill path (`GraphAttention`, what plain decode used through the fourteenth pass: its prefill kernel and its split
merge) against the one-kernel Triton decode attention (`specdec.kernels.paged_decode`) at a few block sizes, warp
counts and split limits. Each variant runs over 32 layers' caches captured in one CUDA graph (as the 32 layers of
a forward would), timed per layer call; `max_abs_diff` is against flashinfer's output. Issue 6: flashinfer spent
~11.5 us a layer at batch 1. `--tree`: the queries are a tree verify's (8 children of the root, each growing a
chain, as `step_breakdown.py`'s tree64), flashinfer's captured path with its custom mask against the Triton
kernel with the packed mask; `plan_us` is each side's host plan of one forward.

    python bench/decode_attn_micro.py [--batch-sizes 1,2,4,8,16,32] [--contexts 384,2048] [--queries 1,9]
        [--variants 128x4,64x4s8,128x4s8r32] [--tree] [--out attn.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.attention.batch import SeqAttention  # noqa: E402
from specdec.attention.graph_backend import GraphAttention, capture_graph  # noqa: E402
from specdec.attention.triton_decode import TritonDecodeAttention  # noqa: E402
from specdec.kernels.paged_decode import SPLITS, pack_tree_masks, paged_decode, tiling  # noqa: E402
from specdec.tree import ancestor_mask  # noqa: E402

HEADS, KV, D, PS, LAYERS = 32, 8, 128, 16, 32


class _Cache:
    def __init__(self, num_pages: int):
        self.page_size = PS
        self.k = torch.randn(LAYERS, num_pages * PS, KV, D, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn_like(self.k)


def graph_us(body, calls: int = LAYERS, repeats: int = 20) -> float:
    graph, _ = capture_graph(body, None)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats / calls


def tree_mask(nq: int) -> torch.Tensor:
    """step_breakdown's tree64 shape cut to nq nodes: 8 children of the root, each growing a chain."""
    topk = min(8, nq - 1)
    return ancestor_mask([-1] * topk + [i - topk for i in range(topk, nq - 1)])


def plan_us(plan, repeats: int = 50) -> float:
    """Host microseconds of one plan (the GPU idle, synced after)."""
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        plan()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / repeats


def one_case(b: int, ctx: int, width: int, variants, nq: int = 1, tree: bool = False) -> dict:
    cache = _Cache(b * width + 4)
    perm = torch.randperm(b * width, device="cpu").tolist()
    page_lists = [perm[i * width:(i + 1) * width] for i in range(b)]
    lens = [ctx] * b
    q = torch.randn(b * nq, HEADS, D, device="cuda", dtype=torch.bfloat16)
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    fi = GraphAttention(cache, HEADS, b, nq, width, workspace, causal=not tree)
    row = {"batch": b, "queries": nq, "context": ctx, "tree": tree}
    if tree:
        mask = tree_mask(nq)
        seqs = [SeqAttention(torch.tensor([p[i // PS] * PS + i % PS for i in range(ctx)]), nq, mask)
                for p in page_lists]
        slots = torch.cat([s.ctx_slots[-nq:] for s in seqs])
        row["flashinfer_plan_us"] = round(plan_us(lambda: fi.plan(seqs, slots)), 1)
        tri = TritonDecodeAttention(cache, b, width, nq, HEADS, tree=True)
        row["triton_plan_us"] = round(plan_us(lambda: tri.plan(seqs, slots)), 1)
        packed = pack_tree_masks([mask] * b).cuda()
    else:
        fi.plan_causal(page_lists, lens)
        packed = None
    paged = [(cache.k[i].view(-1, PS, KV, D), cache.v[i].view(-1, PS, KV, D)) for i in range(LAYERS)]
    outs = {}

    def run_fi():
        outs["fi"] = [fi.wrapper.run(q, paged[i]) for i in range(LAYERS)]

    row["flashinfer_us"] = round(graph_us(run_fi), 2)
    table = torch.tensor([pl for pl in page_lists], dtype=torch.int32, device="cuda")
    lens_t = torch.tensor(lens, dtype=torch.int32, device="cuda")
    more = {"queries": nq} if nq > 1 else {}
    for name, block, warps, splits, most in variants:
        counters = torch.zeros(b * KV * tiling(nq * HEADS // KV, most)[1], dtype=torch.int32, device="cuda")

        def run_tr(block=block, warps=warps, splits=splits, most=most, counters=counters):
            outs["tr"] = [paged_decode(q, cache.k[i], cache.v[i], table, lens_t, PS, D ** -0.5, counters, block,
                                       warps, splits=splits, mask=packed, rows=most, **more)
                          for i in range(LAYERS)]

        us = graph_us(run_tr)
        diff = max((a.float() - c.float()).abs().max().item() for a, c in zip(outs["tr"], outs["fi"], strict=True))
        row[f"triton_{name}_us"] = round(us, 2)
        row.setdefault("triton_max_abs_diff", 0.0)
        row["triton_max_abs_diff"] = max(row["triton_max_abs_diff"], round(diff, 5))
    return row


def _variant(text: str) -> tuple[str, int, int, int, int | None]:
    """'128x4' (block x warps), '128x4s8' (and at most 8 splits), '128x4s8r32' (and at most 32 rows a program):
    (name, block, warps, splits, rows)."""
    rest, _, most = text.partition("r")
    size, _, splits = rest.partition("s")
    block, warps = (int(x) for x in size.split("x"))
    return text, block, warps, int(splits) if splits else SPLITS, int(most) if most else None


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    ap.add_argument("--contexts", default="384,2048")
    ap.add_argument("--max-context", type=int, default=4096, help="the page table's width, as the engine's graphs")
    ap.add_argument("--variants", default="128x4,64x4,32x4,128x8",
                    help="block x warps [s most splits] of the Triton kernel (the shipped: 128x4, 32 splits)")
    ap.add_argument("--queries", default="1", help="causal query tokens per request (a chain verify: drafts + 1)")
    ap.add_argument("--tree", action="store_true", help="the queries are a tree's (a mask each), not a chain's")
    ap.add_argument("--out", default="decode_attn.json")
    args = ap.parse_args()
    width = -(-args.max_context // PS) + 1
    variants = [_variant(v) for v in args.variants.split(",")]
    rows = []
    for nq in (int(x) for x in args.queries.split(",")):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            for ctx in (int(x) for x in args.contexts.split(",")):
                rows.append(one_case(b, ctx, width, variants, nq, args.tree))
                print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
