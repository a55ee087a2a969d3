"""What a plain call costs with a draft present against without (issue 10), on a GPU: 8B-shaped target and
EAGLE-1-shaped head with random weights, `--batch-size` requests of 256-token prompts, 128 new tokens.

    python bench/plain_call_cost.py --batch-size 128 --out plain_call_cost.json

`auto` at 128 requests, SIMULATED tau 3, decodes plainly (the half chain and plain decoding measure within a few
percent there), yet its plain calls ran ~3% longer than those of plain decoding without a draft (seventeenth and
eighteenth passes). Runs, alternating: plain decoding (no draft) and `auto` with a policy trained to decode plainly;
for each, every call's wall time, and from the profiler (one more run of each) the GPU time per kernel name, so
a difference shows as GPU work (which kernels) or as time the GPU sat idle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from gpu_bench import _decode_rate, _opts, simulated_draft  # noqa: E402

from specdec.engine.adaptive import SpeculationPolicy, budget_menu  # noqa: E402
from specdec.engine.factory import build_target  # noqa: E402
from specdec.engine.requests import StepTimings  # noqa: E402


def plain_call_ms(timings: StepTimings) -> list[float]:
    """ms per target step of each plain call of a timed run."""
    return [1e3 * secs / steps for spec, _, steps, secs, _ in timings.calls if not spec]


def kernels(run) -> dict:
    """GPU ms per kernel name over one run."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    by_name: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            by_name[ev.name[:80]] += ev.device_time_total / 1e3
    return dict(by_name)


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--tau", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="plain_call_cost.json")
    args = ap.parse_args()
    bs = args.batch_size
    opts = _opts("flashinfer", dummy_weights=True, max_batch_size=bs, max_context=4096, num_pages=8192)
    target = build_target("llama3-8b", opts)
    draft = simulated_draft(target, "llama3-8b-eagle1", "flashinfer", bs)
    n = draft.spec.num_draft_tokens
    prompts = [list(range(1000 + i, 1256 + i)) for i in range(bs)]
    target.simulate_accept_len = args.tau
    policy = SpeculationPolicy(budget_menu(n), history=[])
    _decode_rate(target, draft, prompts, 128, policy=policy)  # trains the policy
    runs = {"plain": lambda t=None: _decode_rate(target, None, prompts, 128, timings=t),
            "auto": lambda t=None: _decode_rate(target, draft, prompts, 128, policy=policy, timings=t)}
    res: dict = {"batch_size": bs, "tau": args.tau, "policy": policy.summary(), "rounds": []}
    for r in range(args.rounds):
        row = {}
        for name in (("plain", "auto") if r % 2 == 0 else ("auto", "plain")):
            t = StepTimings(calls=[])
            rate, _ = runs[name](t)
            ms = plain_call_ms(t)
            row[name] = {"tok_s": round(rate, 1), "plain_calls": len(ms),
                         "median_ms_per_step": round(statistics.median(ms), 3) if ms else None,
                         "admit_s": round(t.admit_s, 3)}
        res["rounds"].append(row)
        print(r, json.dumps(row), flush=True)
    profiled = {name: kernels(run) for name, run in runs.items()}
    names = sorted(set(profiled["plain"]) | set(profiled["auto"]),
                   key=lambda k: -abs(profiled["auto"].get(k, 0) - profiled["plain"].get(k, 0)))
    res["gpu_ms_total"] = {name: round(sum(p.values()), 2) for name, p in profiled.items()}
    res["gpu_ms_by_kernel_largest_differences"] = [
        [k, round(profiled["plain"].get(k, 0), 2), round(profiled["auto"].get(k, 0), 2)] for k in names[:25]]
    print("gpu ms total", res["gpu_ms_total"], flush=True)
    for k, a, b in res["gpu_ms_by_kernel_largest_differences"]:
        print(f"  {a:9.2f} {b:9.2f}  {k}", flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
