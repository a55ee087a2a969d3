"""Where one engine step of the 8B-shaped target (and its EAGLE-1 head) spends its time, on a GPU.

    python bench/step_breakdown.py --out breakdown.json

For plain decode (1 token) and a chain verify (1 + 8 tokens; `--rows` adds `tree64`, a 64-token tree) at each of
`--batch-sizes` (default 1; requests of `--context` prompt tokens) it reports:
- `replay_ms`: the captured forward alone, replayed back to back (pure GPU time of the graph);
- `step_ms`: a whole `TargetEngine.verify` call (host work + graph + logits + acceptance), synced;
- `host_ms`: step_ms - replay_ms - logits_ms, the host time the GPU waits for;
- `pre_launch_ms` / `post_sync_ms`: of that host time, what runs before the graph is launched (parsing, page tables,
  the attention plan, input copies) and after the step's one sync (acceptance, features, commit);
  `features_to_host_ms`: the target service's copy of a step's features to host memory (its engine thread);
- the GPU kernels of one replay by category (GEMM, attention, elementwise), from the profiler;
- the top host functions of 50 steps (cProfile, by cumulative and by own time), written next to `--out`.
The same for the draft head's propose and extend, for each of `--draft-specs` (steps,topk,draft tokens; default a
chain of 6); a tree's propose (topk > 1) also eagerly (`propose_eager_ms`: one host sync a depth) beside its
captured graph. Numbers are means over `--repeats` calls after warm-up.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.engine.draft_engine import SpecConfig  # noqa: E402
from specdec.engine.factory import EngineOptions, build_draft, build_target  # noqa: E402
from specdec.engine.requests import PrefillInput, VerifyInput  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402

# row label -> (draft tokens a request, topk): chains, and the 64-token tree of gpu_bench's verify rows (8 roots'
# children, then one child each)
ROWS = {"decode": (0, 1), "verify8": (8, 1), "verify5": (5, 1), "tree64": (64, 8)}
DEFAULT_ROWS = "decode,verify8,verify5"


def tree_parents(n_draft: int, topk: int) -> list[int]:
    """A chain (topk 1), or topk children of the root each growing a chain (gpu_bench's 64-token tree)."""
    if topk == 1:
        return list(range(-1, n_draft - 1))
    return [-1] * topk + [i - topk for i in range(topk, n_draft)]


def timed(fn, repeats: int) -> float:
    """Mean seconds per call, synced before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def kernel_table(fn, repeats: int = 5) -> dict:
    """GPU time per call by kernel category (CUPTI sees kernels inside graph replays)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    cats: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name != "CUDA":
            continue
        name = ev.name.lower()
        cat = ("gemm" if any(k in name for k in ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "matmul", "splitk"))
               else "attention" if any(k in name for k in ("flashinfer", "prefill", "decode", "batchprefill"))
               else "memcpy" if "memcpy" in name or "memset" in name else "other")
        c = cats.setdefault(cat, [0.0, 0])
        c[0] += ev.device_time_total / 1e3 / repeats if hasattr(ev, "device_time_total") else 0.0
        c[1] += 1 / repeats
    top = sorted(((e.key, e.device_time_total / 1e3 / repeats, e.count / repeats)
                  for e in prof.key_averages()), key=lambda x: -x[1])[:15]
    return {"by_category_ms_and_count": {k: [round(v[0], 3), round(v[1], 1)] for k, v in cats.items()},
            "top_kernels": [[k[:90], round(ms, 3), round(n, 1)] for k, ms, n in top]}


def host_profile(fn, repeats: int, path: Path) -> None:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    for order in ("cumulative", "tottime"):  # where the calls lead, then where the time is spent
        pstats.Stats(pr, stream=s).sort_stats(order).print_stats(40)
    path.write_text(s.getvalue())


def timeline(target, inp, repeats: int) -> dict:
    """Mean host ms of one verify before its graph launch and after its sync (the first acceptance walk)."""
    from specdec.rpc.target_codec import features_to_host

    marks: dict[str, float] = {}
    replay, verdict = torch.cuda.CUDAGraph.replay, target._verdict

    def timed_replay(graph):
        marks.setdefault("launch", time.perf_counter())
        return replay(graph)

    def timed_verdict(*a, **k):
        marks.setdefault("synced", time.perf_counter())
        return verdict(*a, **k)

    pre, post, feats = [], [], []
    torch.cuda.CUDAGraph.replay, target._verdict = timed_replay, timed_verdict
    try:
        for _ in range(repeats):
            torch.cuda.synchronize()
            marks.clear()
            t0 = time.perf_counter()
            outs = target.verify(inp)
            t1 = time.perf_counter()
            features_to_host(outs)
            feats.append(time.perf_counter() - t1)
            if "launch" in marks and "synced" in marks:
                pre.append(marks["launch"] - t0)
                post.append(t1 - marks["synced"])
    finally:
        torch.cuda.CUDAGraph.replay = replay
        del target._verdict
    mean = (lambda xs: round(1e3 * sum(xs) / len(xs), 3) if xs else None)
    return {"pre_launch_ms": mean(pre), "post_sync_ms": mean(post), "features_to_host_ms": mean(feats)}


def target_rows(args, out_dir: Path) -> dict:
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    new_tokens = 2048  # ~120 verify calls of up to 9 tokens each per row
    pages_per_request = -(-(args.context + new_tokens + 80) // 16) + 2
    opts = EngineOptions(device="cuda", dtype="bfloat16", attention_backend="flashinfer", dummy_weights=True,
                         max_batch_size=max(sizes), max_context=4096,
                         num_pages=max(4096, max(sizes) * pages_per_request + 64))
    target = build_target("llama3-8b", opts)
    res = {}
    prompt = [1000 + i % 20000 for i in range(args.context)]
    for b in sizes:
        for label in args.rows.split(","):
            n_draft, topk = ROWS[label]
            if b == 1 and label == "verify5" and args.rows == DEFAULT_ROWS:
                continue  # batch 1 keeps its historical rows (decode, verify8)
            key = label if b == 1 else f"{label}_bs{b}"
            rids = [f"r-{key}-{i}" for i in range(b)]
            target.prefill([PrefillInput(rid, prompt, SamplingParams(max_new_tokens=new_tokens,
                                                                          ignore_eos=True)) for rid in rids])
            inp = [VerifyInput(rid, [7] * n_draft, tree_parents(n_draft, topk)) for rid in rids]
            for _ in range(3):
                target.verify(inp)  # captures the graphs on first use
            graphs = target.graphs
            bucket = next((x for x in graphs.ladder if x >= b), None) if graphs else None
            g = graphs.graphs.get((bucket, n_draft + 1, (), topk == 1)) if graphs else None
            if graphs:  # what a forward of these contexts replays (the Triton kernel's graph, where it serves it)
                g = graphs.triton_graph(bucket, n_draft + 1, (), args.context + n_draft + 1, topk == 1) or g
            row = {"batch": b, "tokens_per_request": n_draft + 1, "context": args.context}
            if g is not None:
                row["replay_ms"] = round(timed(g.graph.replay, args.repeats) * 1e3, 3)
                row["replay_kernels"] = kernel_table(g.graph.replay)
                hid = g.hidden[: b * (n_draft + 1)]
                row["logits_argmax_ms"] = round(timed(lambda h=hid: target.model.compute_logits(h).argmax(-1),
                                                      args.repeats) * 1e3, 3)
            row["step_ms"] = round(timed(lambda inp=inp: target.verify(inp), args.repeats) * 1e3, 3)
            if g is not None:
                row["host_ms"] = round(row["step_ms"] - row["replay_ms"] - row["logits_argmax_ms"], 3)
            row.update(timeline(target, inp, args.repeats))
            row["step_kernels"] = kernel_table(lambda inp=inp: target.verify(inp))
            host_profile(lambda inp=inp: target.verify(inp), 50, out_dir / f"host_{key}.txt")
            for rid in rids:
                target.release(rid)
            res[key] = row
            print(key, json.dumps(row)[:3000], flush=True)
    res["weight_GB"] = round(sum(p.numel() * p.element_size() for p in target.model.parameters()) / 1e9, 3)
    return res, target


def draft_rows(args, out_dir: Path, max_context: int) -> dict:
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    pages_per_request = -(-(args.context + 3000) // 16) + 2
    opts = EngineOptions(device="cuda", dtype="bfloat16", attention_backend="flashinfer", dummy_weights=True,
                         max_batch_size=max(sizes), max_context=4096,
                         num_pages=max(2048, max(sizes) * pages_per_request + 64))
    feats = torch.randn(max(args.context, 512), 4096, device="cuda", dtype=torch.bfloat16)
    res = {}
    for text in args.draft_specs.split(";"):
        spec = SpecConfig(*(int(x) for x in text.split(",")))
        draft = build_draft("llama3-8b-eagle1", "llama3-8b", spec, opts, max_context)
        label = "" if (spec.num_steps, spec.topk, spec.num_draft_tokens) == (6, 1, 6) else (
            f"_s{spec.num_steps}k{spec.topk}d{spec.num_draft_tokens}")
        for b in sizes:
            sfx = label + ("" if b == 1 else f"_bs{b}")
            res.update(_draft_batch(draft, b, sfx, feats, args, out_dir))
        del draft
        torch.cuda.empty_cache()
    return res


def _draft_batch(draft, b: int, sfx: str, feats, args, out_dir: Path) -> dict:
    res = {}
    rids = [f"d{b}-{i}" for i in range(b)]
    for rid in rids:
        draft.add(rid, 3000)
    draft.extend([(rid, list(range(args.context)), feats[: args.context]) for rid in rids])
    for _ in range(3):
        draft.propose(rids)
    res["propose_ms" + sfx] = round(timed(lambda: draft.propose(rids), args.repeats) * 1e3, 3)
    res["propose_kernels" + sfx] = kernel_table(lambda: draft.propose(rids))
    host_profile(lambda: draft.propose(rids), 50, out_dir / f"host_propose{sfx}.txt")
    if draft.spec.topk > 1 and draft.graphs is not None:  # the same trees without the graph, side by side
        graphs, draft.graphs = draft.graphs, None
        draft.propose(rids)
        res["propose_eager_ms" + sfx] = round(timed(lambda: draft.propose(rids), args.repeats) * 1e3, 3)
        draft.graphs = graphs
    lens = {rid: draft.requests[rid].kv_len for rid in rids}

    def extend4():
        draft.extend([(rid, [5, 6, 7, 8], feats[:4]) for rid in rids])
        for rid in rids:
            draft.kv.resize(rid, lens[rid])
            draft.requests[rid].kv_len = lens[rid]

    res["extend4_ms" + sfx] = round(timed(extend4, args.repeats) * 1e3, 3)
    res["extend4_kernels" + sfx] = kernel_table(extend4)
    host_profile(extend4, 50, out_dir / f"host_extend{sfx}.txt")
    for rid in rids:
        draft.release(rid)
    print("draft", sfx or "s6k1d6", b, res["propose_ms" + sfx], res.get("propose_eager_ms" + sfx),
          res["extend4_ms" + sfx], flush=True)
    return res


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="breakdown.json")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--batch-sizes", default="1", help="target rows at these batch sizes, e.g. 1,32,128")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of each request")
    ap.add_argument("--rows", default=DEFAULT_ROWS, help=f"target rows, of {','.join(ROWS)}")
    ap.add_argument("--skip-draft", action="store_true", help="target rows only")
    ap.add_argument("--skip-target", action="store_true", help="draft rows only")
    ap.add_argument("--draft-specs", default="6,1,6",
                    help="draft rows for each 'steps,topk,draft tokens', ';'-separated, e.g. '6,1,6;6,4,16'")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    max_context = 4096
    if not args.skip_target:
        res["target"], target = target_rows(args, out.parent)
        max_context = target.max_context
        del target
    out.write_text(json.dumps(res, indent=1))
    if not args.skip_draft:
        res["draft"] = draft_rows(args, out.parent, max_context)
    out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
