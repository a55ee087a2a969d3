"""`--speculation auto` at batch 1, prompt by prompt, next to plain decoding and always-on speculation (in-process,
shipped tiny pair, chain of 5; a fresh policy per prompt, as a fresh service would start). Prints each run's
tokens/s and the policy's measured rates, then the total seconds of each mode over all prompts (lower is better).

    python bench/auto_small_batch.py [--draft draft|draft-eagle3] [--new-tokens 128] [--prompts 6] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.engine.adaptive import SpeculationPolicy, budget_menu  # noqa: E402
from specdec.engine.draft_engine import SpecConfig  # noqa: E402
from specdec.engine.factory import EngineOptions, build_draft, build_target  # noqa: E402
from specdec.engine.generate import generate  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402
from specdec.tokenizer import load_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "tiny-code"
DEV_PROMPTS = ROOT.parent / "shared" / "prompts" / "dev.jsonl"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="draft", help="draft (EAGLE-1) or draft-eagle3")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=6, help="dev prompts 50.. (held apart from the tests' range)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    gpu = args.device.startswith("cuda")
    opts = EngineOptions(device=args.device, dtype="bfloat16" if gpu else "float32",
                         attention_backend="flashinfer" if gpu else "torch", max_batch_size=8, num_pages=8192)
    target = build_target(str(TINY / "target"), opts)
    spec = SpecConfig(5, 1, 5)
    draft = build_draft(str(TINY / args.draft), str(TINY / "target"), spec, opts, target.max_context)
    tok = load_tokenizer(TINY / "target")
    lines = [json.loads(x)["prompt"] for x in DEV_PROMPTS.read_text().splitlines() if x.strip()]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    total = {"plain": 0.0, "always": 0.0, "auto": 0.0}
    for i in range(args.prompts):
        prompts = [tok.encode(lines[50 + i])[-200:]]
        for mode in total:
            policy = SpeculationPolicy(budget_menu(spec.num_draft_tokens)) if mode == "auto" else None
            t0 = time.perf_counter()
            out = generate(target, None if mode == "plain" else draft, prompts, params, max_batch_size=1,
                           policy=policy)
            seconds = time.perf_counter() - t0
            total[mode] += seconds
            print(json.dumps({"prompt": 50 + i, "mode": mode, "tok_s": round(len(out[0].tokens) / seconds, 1),
                              "rates": policy.summary() if policy else {}}), flush=True)
    print(json.dumps({"total_s": {k: round(v, 2) for k, v in total.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
