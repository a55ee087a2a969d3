"""Does following a policy cost a speculative step time? (issue 10): in-process, 8B shape, SIMULATED acceptance, the
same whole-tree steps run with no policy (`--speculation always`), with a policy whose menu is the whole tree alone,
and with `auto`'s menu, in alternating rounds in one process, so a difference is the code path's, not the GPU's
drift between runs.

    python bench/policy_step_ab.py --batch-sizes 8,32 --tau 5 --rounds 3 --new-tokens 256 --out ab.json

Per arm: tokens/s of each timed run and the median seconds of its whole-tree steps at the full batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_bench  # noqa: E402

from specdec.engine.adaptive import FULL, SpeculationPolicy, budget_menu  # noqa: E402
from specdec.engine.factory import build_target  # noqa: E402
from specdec.engine.requests import StepTimings  # noqa: E402


def _arm(target, draft, prompts, new_tokens, menu):
    policy = None if menu is None else SpeculationPolicy(menu)
    if policy is not None:  # trained by a first run, as a service's policy is by its first requests
        gpu_bench._decode_rate(target, draft, prompts, new_tokens, policy=policy, warm_up=False)
    timings = StepTimings(calls=[])
    rate, tau = gpu_bench._decode_rate(target, draft, prompts, new_tokens, policy=policy, timings=timings)
    full = [c[3] for c in timings.calls if c[0] and c[1] == len(prompts)]
    return {"tok_s": round(rate, 1), "tau": round(tau, 2), "full_steps": len(full),
            "full_step_ms": round(statistics.median(full) * 1e3, 3) if full else None,
            "plain_calls": sum(1 for c in timings.calls if not c[0])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="policy_step_ab.json")
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--tau", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--draft-config", default="llama3-8b-eagle3")
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    opts = gpu_bench._opts(args.backend, dummy_weights=True, max_batch_size=max(sizes), max_context=4096,
                           num_pages=8192)
    target = build_target("llama3-8b", opts)
    draft = gpu_bench.simulated_draft(target, args.draft_config, args.backend, max(sizes))
    menus = {"always": None, "policy-full-only": (FULL,), "auto": budget_menu(draft.spec.num_draft_tokens)}
    res = {"args": vars(args), "SIMULATED_tau": args.tau, "rows": []}
    target.simulate_accept_len = args.tau
    for bs in sizes:
        prompts = [list(range(1000 + i, 1256 + i)) for i in range(bs)]
        for r in range(args.rounds):
            for name, menu in menus.items():
                row = {"bs": bs, "round": r, "arm": name, **_arm(target, draft, prompts, args.new_tokens, menu)}
                res["rows"].append(row)
                print("SIMULATED", row, flush=True)
                Path(args.out).write_text(json.dumps(res, indent=1))
    for bs in sizes:
        for name in menus:
            rows = [x for x in res["rows"] if x["bs"] == bs and x["arm"] == name]
            rates, steps = [x["tok_s"] for x in rows], [x["full_step_ms"] for x in rows]
            print(f"bs {bs} {name}: tok/s {rates} full-step ms {steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
