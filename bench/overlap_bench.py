"""Two-batch overlap (issue 10) on the 8B shape with simulated acceptance: tokens/s and GPU busy fractions of
plain decoding, speculation one step at a time, and speculation in two micro-batches that take turns, per batch
size, with the draft on its own GPU (and, for comparison, on the target's).

    python bench/overlap_bench.py --out overlap.json                  # two GPUs (nvidia-h200-x2): cuda:0 + cuda:1
    python bench/overlap_bench.py --placements shared --batch-sizes 8  # one GPU

Rows are SIMULATED acceptance (`--simulate-accept-len`): their outputs are not the target's. Busy fractions are
NVML's utilization averaged over the timed run (bench/gpu_busy.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import _decode_rate, _split  # noqa: E402
from gpu_busy import GpuBusy  # noqa: E402

from specdec.engine.adaptive import SpeculationPolicy, budget_menu  # noqa: E402
from specdec.engine.draft_engine import SpecConfig  # noqa: E402
from specdec.engine.factory import EngineOptions, build_draft, build_target  # noqa: E402
from specdec.engine.overlap import TwoBatchOverlap  # noqa: E402
from specdec.engine.requests import StepTimings  # noqa: E402

PLACEMENTS = {"split": ("cuda:0", "cuda:1"), "shared": ("cuda:0", "cuda:0")}


def _opts(device: str, max_batch: int) -> EngineOptions:
    return EngineOptions(device=device, dtype="bfloat16", attention_backend="flashinfer", dummy_weights=True,
                         max_batch_size=max_batch, max_context=4096, num_pages=16384)


def run_placement(name: str, args) -> list[dict]:
    target_dev, draft_dev = PLACEMENTS[name]
    max_batch = max(args.batch_sizes)
    target = build_target("llama3-8b", _opts(target_dev, max_batch))
    with torch.cuda.device(torch.device(draft_dev)):
        draft = build_draft("llama3-8b-eagle1", "llama3-8b", SpecConfig(6, 1, 6), _opts(draft_dev, max_batch),
                            target.max_context)
    gpus = sorted({torch.device(target_dev).index, torch.device(draft_dev).index})
    rows = []
    for bs in args.batch_sizes:
        prompts = [list(range(1000 + i, 1000 + i + args.prompt_tokens)) for i in range(bs)]
        target.simulate_accept_len = 0.0
        busy = GpuBusy(gpus)
        plain, _ = _decode_rate(target, None, prompts, args.new_tokens, busy=busy)
        row = {"placement": name, "target": target_dev, "draft": draft_dev, "bs": bs, "plain_tok_s": round(plain, 1),
               "plain_busy": busy.fractions}
        for tau in args.taus:
            target.simulate_accept_len = tau
            for mode in args.modes:
                overlap = TwoBatchOverlap(args.min_batch, target_dev) if mode.endswith("overlap") else None
                policy = SpeculationPolicy(budget_menu(6)) if mode.startswith("auto") else None
                busy, timings = GpuBusy(gpus), StepTimings()
                rate, tps = _decode_rate(target, draft, prompts, args.new_tokens, policy=policy, timings=timings,
                                         overlap=overlap, busy=busy)
                key = f"tau{tau:g}_{mode}"
                row[f"{key}_tok_s"] = round(rate, 1)
                row[f"{key}_vs_plain"] = round(rate / plain, 2)
                row[f"{key}_busy"] = busy.fractions
                row[f"{key}_split"] = _split(timings)
                if overlap is not None:
                    row[f"{key}_micro_steps"] = overlap.micro_steps
        target.simulate_accept_len = 0.0
        print("SIMULATED", json.dumps(row), flush=True)
        rows.append(row)
    del target, draft
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="overlap_bench.json")
    ap.add_argument("--placements", default="split,shared", help="split (cuda:0 + cuda:1) and/or shared (cuda:0)")
    ap.add_argument("--batch-sizes", default="8,32,64")
    ap.add_argument("--taus", default="3,5", help="simulated mean tokens per step")
    ap.add_argument("--modes", default="always,always_overlap,auto,auto_overlap")
    ap.add_argument("--min-batch", type=int, default=2, help="TwoBatchOverlap's min_batch_size for overlap modes")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    args = ap.parse_args()
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.taus = [float(x) for x in args.taus.split(",")]
    args.modes = args.modes.split(",")
    res = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
           "torch": torch.__version__, "args": vars(args), "rows": []}
    for name in args.placements.split(","):
        if name == "split" and torch.cuda.device_count() < 2:
            res["split_skipped"] = "needs two GPUs"
            continue
        t0 = time.time()
        res["rows"] += run_placement(name, args)
        res[f"{name}_seconds"] = round(time.time() - t0, 1)
        Path(args.out).write_text(json.dumps(res, indent=1))
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
