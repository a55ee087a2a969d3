"""Adaptive speculation on the tiny trained pair, in-process: plain decoding vs speculating every step vs the
adaptive policy with two budgets (plain / whole tree) and with the menu (plain / half the tree / whole tree).

    python bench/adaptive_budgets.py --batch-sizes 1,8,32                      # CPU
    python bench/adaptive_budgets.py --device cuda --backend flashinfer        # GPU

Each policy is trained by one untimed run; tokens/s is the best of `--repeats` timed runs after it. Greedy,
`ignore_eos`, prompts = the last 256 tokens of ../shared/prompts/dev.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.engine.adaptive import FULL, SpeculationPolicy, budget_menu  # noqa: E402
from specdec.engine.draft_engine import SpecConfig  # noqa: E402
from specdec.engine.factory import EngineOptions, build_draft, build_target  # noqa: E402
from specdec.engine.generate import generate  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402
from specdec.tokenizer import load_tokenizer  # noqa: E402

TINY = ROOT / "models" / "tiny-code"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--spec", default="6,4,16", help="num_steps,topk,num_draft_tokens")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--prompts", default=str(ROOT.parent / "shared" / "prompts" / "dev.jsonl"))
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    spec = SpecConfig(*(int(x) for x in args.spec.split(",")))
    opts = EngineOptions(device=args.device, attention_backend=args.backend, num_pages=16384,
                         max_batch_size=max(sizes))
    target = build_target(str(TINY / "target"), opts)
    draft = build_draft(str(TINY / "draft"), str(TINY / "target"), spec, opts, target.max_context)
    tok = load_tokenizer(TINY / "target")
    lines = [json.loads(x)["prompt"] for x in Path(args.prompts).read_text().splitlines() if x.strip()]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    modes = (("plain", None, lambda: None), ("always", draft, lambda: None),
             ("auto plain/full", draft, lambda: SpeculationPolicy((0, FULL))),
             ("auto menu", draft, lambda: SpeculationPolicy(budget_menu(spec.num_draft_tokens))))
    print(f"device {args.device}, torch threads {torch.get_num_threads()}, spec {args.spec}, "
          f"{args.new_tokens} new tokens", flush=True)
    for bs in sizes:
        prompts = [tok.encode(lines[i % len(lines)])[-256:] for i in range(bs)]
        row = {"bs": bs}
        for label, d, make in modes:
            policy = make()
            generate(target, d, prompts, params, max_batch_size=bs, policy=policy)  # warm-up / training
            best = 0.0
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                out = generate(target, d, prompts, params, max_batch_size=bs, policy=policy)
                best = max(best, sum(len(r.tokens) for r in out) / (time.perf_counter() - t0))
            row[label] = round(best, 1)
            if policy is not None:
                row[label + " rates"] = policy.summary()
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
