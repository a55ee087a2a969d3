"""The kernels' launch settings side by side in one process (issue 6): 8B-shaped targets with random weights whose
Triton kernels launch without programmatic dependent launch ("off"), with it ("pdl", `specdec/kernels/pdl.py`), with
it and the projections reading their first weight chunk before the wait ("pdl+early", the default), and the
default with projections of 2-16 rows left to cuBLAS ("cublas-rows": `SPECDEC_SKINNY=0`, no
`specdec/kernels/skinny.py`), measured in rotating rounds (a lent machine's speed drifts between processes and
calls by more than the effect).

    python bench/pdl_ab.py --rounds 3 [--variants cublas-rows,pdl+early] --out pdl_ab.json

Per target and round: the batch-1 plain decode graph and the chain-of-8 verify graph replayed back to back (GPU
time alone), verify calls of 8 and of 6 drafts (host work included), plain decode tokens/s at 1, 4 and 16 tokens a
call (128 new tokens after a 512-token prompt) and of 4 requests at 16 a call; with `--draft-config`, speculative
tokens/s at batch 1 (SIMULATED acceptance, 256 new tokens) and the ms a step of its propose, verify and extend.
Prints each round and the medians with their ratios to the first variant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_bench import _decode_rate, _sync_time, simulated_draft  # noqa: E402

from specdec import kernels  # noqa: E402
from specdec.engine.factory import EngineOptions, build_target  # noqa: E402
from specdec.engine.requests import PrefillInput, StepTimings, VerifyInput  # noqa: E402
from specdec.kernels import pdl  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402

PROMPT = list(range(1000, 1512))
# SPECDEC_PDL, SPECDEC_GEMV_EARLY, SPECDEC_SKINNY (the few-rows kernel, `specdec/kernels/skinny.py`)
VARIANTS = {"off": ("0", "0", "1"), "pdl": ("1", "0", "1"), "pdl+early": ("1", "1", "1"),
            "cublas-rows": ("1", "1", "0")}


def use(name: str) -> None:
    """The variant's settings for the kernels launched from now on (captured graphs keep theirs)."""
    os.environ["SPECDEC_PDL"], os.environ["SPECDEC_GEMV_EARLY"], os.environ["SPECDEC_SKINNY"] = VARIANTS[name]
    pdl._pdl_on.cache_clear()
    pdl.early_weights.cache_clear()
    kernels._skinny_on.cache_clear()


def build(name: str):
    use(name)
    opts = EngineOptions(device="cuda", dtype="bfloat16", attention_backend="flashinfer", dummy_weights=True,
                         max_batch_size=4, max_context=4096, num_pages=1024)
    return build_target("llama3-8b", opts)


def replay_ms(target, n: int, repeats: int) -> float | None:
    """GPU ms of the captured batch-1 forward of n tokens a request (the graph a 512-token context replays)."""
    graphs = target.graphs
    g = graphs.triton_graph(1, n, (), len(PROMPT) + 140) or graphs.graphs.get((1, n, (), True))
    if g is None:
        return None
    g.graph.replay()
    t, _ = _sync_time(g.graph.replay, repeats)
    return t * 1e3


def measure(target, name: str, repeats: int, draft=None) -> dict:
    use(name)
    row = {}
    if draft is not None:  # batch 1, speculation always, SIMULATED acceptance; ms a step of each part
        for tau in (3.0, 5.0):
            target.simulate_accept_len = tau
            timings = StepTimings()
            rate, _ = _decode_rate(target, draft, [PROMPT], 256, timings=timings)
            row[f"SIMULATED_tau{tau:g}_spec_tok_s"] = rate
            for part in ("propose", "verify", "extend"):
                row[f"tau{tau:g}_{part}_ms"] = 1e3 * getattr(timings, f"{part}_s") / max(timings.spec_steps, 1)
        target.simulate_accept_len = 0.0
    rid = "v8"
    target.prefill([PrefillInput(rid, PROMPT, SamplingParams(max_new_tokens=10000, ignore_eos=True))])
    inp = [VerifyInput(rid, [7] * 8, list(range(-1, 7)))]
    for _ in range(3):
        target.verify(inp)
    t, _ = _sync_time(lambda: target.verify(inp), repeats)
    row["verify8_call_ms"] = t * 1e3
    chain6 = [VerifyInput(rid, [7] * 6, list(range(-1, 5)))]  # the simulated rows' chain of 6: 7 rows
    for _ in range(3):
        target.verify(chain6)
    t, _ = _sync_time(lambda: target.verify(chain6), repeats)
    row["verify6_call_ms"] = t * 1e3
    target.release(rid)
    row["decode_replay_ms"] = replay_ms(target, 1, repeats)
    row["verify8_replay_ms"] = replay_ms(target, 9, repeats)
    for steps in (1, 4, 16):
        rate, _ = _decode_rate(target, None, [PROMPT], 128, plain_steps=steps)
        row[f"plain_tok_s_{steps}_per_call"] = rate
    rate, _ = _decode_rate(target, None, [PROMPT[i:] for i in range(4)], 128, plain_steps=16)
    row["plain_tok_s_bs4_16_per_call"] = rate
    return row


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="which, comma-separated; ratios to the first")
    ap.add_argument("--draft-config", default="", help="also speculative tok/s at batch 1 with this 8B-shaped head "
                    "(e.g. llama3-8b-eagle3), chain of 6, SIMULATED tau 3 and 5")
    ap.add_argument("--out", default="pdl_ab.json")
    args = ap.parse_args()
    names = args.variants.split(",")
    targets = {name: build(name) for name in names}
    drafts = {}
    for name in names if args.draft_config else ():
        use(name)
        drafts[name] = simulated_draft(targets[name], args.draft_config, "flashinfer", 4)
    assert pdl.launch_dependent(torch.zeros(1, device="cuda")), "PDL is not available on this GPU / Triton"
    rows: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            row = measure(targets[name], name, args.repeats, drafts.get(name))
            rows[name].append(row)
            print(r, name, {k: round(v, 3) for k, v in row.items() if v is not None}, flush=True)
    summary = {}
    base = names[0]
    for key, first in rows[base][0].items():
        if first is None:
            continue
        med = {name: statistics.median(x[key] for x in rows[name]) for name in names}
        summary[key] = {name: round(v, 3) for name, v in med.items()}
        summary[key].update({f"{name}/{base}": round(med[name] / med[base], 4) for name in names[1:]})
    print("median", json.dumps(summary), flush=True)
    Path(args.out).write_text(json.dumps({"rounds": rows, "median": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
