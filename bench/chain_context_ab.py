"""How long a chain verify's (or a plain decode step's) contexts should attend through the Triton decode kernel rather
than flashinfer (issue 6): `triton_decode.MAX_CHAIN_CONTEXT` (`MAX_CONTEXT` for `--drafts 0`, plain decode) A/B in
one process, on a GPU.

    python bench/chain_context_ab.py --out chain_context.json

For each batch size, chain of `--drafts` draft tokens and context length, the 8B-shaped target (random weights,
flashinfer backend, CUDA graphs) runs `TargetEngine.verify` calls with the limit at each of `--limits`, in turns
(`--rounds` of each), and reports per limit the mean call (host work + graph + logits + acceptance, synced), the host
time before the launch, and the graph replay alone. Above a limit a verify replays flashinfer's graph, whose
attention is planned on the host each step; at or below it, the Triton kernel's, planned by writing device buffers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_breakdown import timed, timeline, tree_parents  # noqa: E402

from specdec.attention import triton_decode  # noqa: E402
from specdec.engine.factory import EngineOptions, build_target  # noqa: E402
from specdec.engine.requests import PrefillInput, VerifyInput  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402


def _fresh(target, b: int, n_draft: int, context: int, tag: str) -> list[VerifyInput]:
    """b new requests of `context` prompt tokens, each verified once (the first call on a shape captures)."""
    prompt = [1000 + i % 20000 for i in range(context)]
    rids = [f"r{tag}-{i}" for i in range(b)]
    target.prefill([PrefillInput(rid, prompt, SamplingParams(max_new_tokens=4000, ignore_eos=True)) for rid in rids])
    inp = [VerifyInput(rid, [7] * n_draft, tree_parents(n_draft, 1)) for rid in rids]
    target.verify(inp)
    return inp


def measure(target, b: int, n_draft: int, context: int, limits: list[int], rounds: int, repeats: int) -> dict:
    """Per limit: mean call ms, host ms before the launch, the replay ms of the graph the step chose, and the
    longest context the calls reached (each call commits 1 + accepted tokens). Fresh requests per round and
    limit, so both limits see the same contexts."""
    graphs = target.graphs
    bucket = next(x for x in graphs.ladder if x >= b)
    n = n_draft + 1
    rows: dict[int, dict[str, list[float]]] = {lim: {"call": [], "pre": [], "replay": [], "reached": []}
                                                for lim in limits}
    limit = "MAX_CONTEXT" if n_draft == 0 else "MAX_CHAIN_CONTEXT"  # plain decode's limit, or chains'
    for r in range(rounds):
        for lim in limits:
            setattr(triton_decode, limit, lim)
            inp = _fresh(target, b, n_draft, context, f"{b}-{n_draft}-{context}-{r}-{lim}")
            g = graphs.triton_graph(bucket, n, (), context + n, True) or graphs.graphs.get((bucket, n, (), True))
            rows[lim]["replay"].append(timed(g.graph.replay, repeats))
            rows[lim]["call"].append(timed(lambda inp=inp: target.verify(inp), repeats))
            rows[lim]["pre"].append(timeline(target, inp, max(repeats // 2, 3))["pre_launch_ms"])
            rows[lim]["reached"].append(max(target._get(v.request_id).kv_len for v in inp) + n)
            for v in inp:
                target.release(v.request_id)
    mean = (lambda xs: sum(xs) / len(xs))
    return {str(lim): {"call_ms": round(1e3 * mean(rows[lim]["call"]), 3),
                       "pre_launch_ms": round(mean(rows[lim]["pre"]), 3),
                       "replay_ms": round(1e3 * mean(rows[lim]["replay"]), 3),
                       "context_reached": max(rows[lim]["reached"]),
                       "triton_from_start": context + n <= lim} for lim in limits}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="chain_context.json")
    ap.add_argument("--batch-sizes", default="1,2,4")
    ap.add_argument("--drafts", default="8,5", help="draft tokens of the chains (0: plain decode)")
    ap.add_argument("--contexts", default="200,640,1024,1536,1750", help="prompt tokens of each request")
    ap.add_argument("--limits", default="512,2048", help="MAX_CHAIN_CONTEXT values compared")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    limits = [int(x) for x in args.limits.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    opts = EngineOptions(device="cuda", dtype="bfloat16", attention_backend="flashinfer", dummy_weights=True,
                         max_batch_size=max(sizes), max_context=4096, num_pages=max(sizes) * 300 + 64)
    target = build_target("llama3-8b", opts)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for b in sizes:
        for n_draft in (int(x) for x in args.drafts.split(",")):
            for context in contexts:
                row = {"batch": b, "drafts": n_draft, "context": context,
                       **measure(target, b, n_draft, context, limits, args.rounds, args.repeats)}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
