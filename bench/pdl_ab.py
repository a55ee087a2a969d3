"""Programmatic dependent launch on vs off, side by side in one process (issue 6): three 8B-shaped targets with
random weights, whose Triton kernels launch without PDL ("off"), with it ("pdl", `specdec/kernels/pdl.py`), and
with it and the one-row projections reading their first weight chunk before the wait ("pdl+early", the default),
measured in rotating rounds (a lent machine's speed drifts between processes and calls by more than the effect).

    python bench/pdl_ab.py --rounds 3 --out pdl_ab.json

Per target and round: the batch-1 plain decode graph and the chain-of-8 verify graph replayed back to back (GPU
time alone), one verify call of 8 drafts (host work included), and plain decode tokens/s at 1, 4 and 16 tokens a
call (128 new tokens after a 512-token prompt). Prints each round and the medians with their ratios to "off".
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

from gpu_bench import _decode_rate, _sync_time  # noqa: E402

from specdec.engine.factory import EngineOptions, build_target  # noqa: E402
from specdec.engine.requests import PrefillInput, VerifyInput  # noqa: E402
from specdec.kernels import gemv, pdl  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402

PROMPT = list(range(1000, 1512))
VARIANTS = {"off": ("0", "0"), "pdl": ("1", "0"), "pdl+early": ("1", "1")}  # SPECDEC_PDL, SPECDEC_GEMV_EARLY


def use(name: str) -> None:
    """The variant's settings for the kernels launched from now on (captured graphs keep theirs)."""
    os.environ["SPECDEC_PDL"], os.environ["SPECDEC_GEMV_EARLY"] = VARIANTS[name]
    pdl._pdl_on.cache_clear()
    gemv.early_weights.cache_clear()


def build(name: str):
    use(name)
    opts = EngineOptions(device="cuda", dtype="bfloat16", attention_backend="flashinfer", dummy_weights=True,
                         max_batch_size=1, max_context=4096, num_pages=1024)
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


def measure(target, name: str, repeats: int) -> dict:
    use(name)
    row = {}
    rid = "v8"
    target.prefill([PrefillInput(rid, PROMPT, SamplingParams(max_new_tokens=10000, ignore_eos=True))])
    inp = [VerifyInput(rid, [7] * 8, list(range(-1, 7)))]
    for _ in range(3):
        target.verify(inp)
    t, _ = _sync_time(lambda: target.verify(inp), repeats)
    row["verify8_call_ms"] = t * 1e3
    target.release(rid)
    row["decode_replay_ms"] = replay_ms(target, 1, repeats)
    row["verify8_replay_ms"] = replay_ms(target, 9, repeats)
    for steps in (1, 4, 16):
        rate, _ = _decode_rate(target, None, [PROMPT], 128, plain_steps=steps)
        row[f"plain_tok_s_{steps}_per_call"] = rate
    return row


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", default="pdl_ab.json")
    args = ap.parse_args()
    targets = {name: build(name) for name in VARIANTS}
    assert pdl.launch_dependent(torch.zeros(1, device="cuda")), "PDL is not available on this GPU / Triton"
    rows: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            row = measure(targets[name], name, args.repeats)
            rows[name].append(row)
            print(r, name, {k: round(v, 3) for k, v in row.items() if v is not None}, flush=True)
    summary = {}
    for key, first in rows["off"][0].items():
        if first is None:
            continue
        med = {name: statistics.median(x[key] for x in rows[name]) for name in VARIANTS}
        summary[key] = {name: round(v, 3) for name, v in med.items()}
        summary[key].update({f"{name}/off": round(med[name] / med["off"], 4) for name in names[1:]})
    print("median", json.dumps(summary), flush=True)
    Path(args.out).write_text(json.dumps({"rounds": rows, "median": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
