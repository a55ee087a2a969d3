"""How much acceptance the draft loses when the target's features cross the wire in fewer bits (CPU, the shipped
tiny pair, real acceptance): the features of every Prefill and Verify are rounded as a narrower wire format
would round them, then the draft runs on them as usual. Output stays the target's (verification is exact); only
tau can change. Formats: bf16 (what GPU pairs send), fp16, fp8 e4m3 with one scale per row, int8 with one scale
per row. A question for a smaller Verify reply (EAGLE-3 replies are 3 x 4096 values per token at 8B).

    python bench/feature_precision.py [--limit 30] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.engine.draft_engine import SpecConfig  # noqa: E402
from specdec.engine.factory import EngineOptions, build_draft, build_target  # noqa: E402
from specdec.engine.generate import generate  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402
from specdec.tokenizer import load_tokenizer  # noqa: E402

TINY = ROOT / "models" / "tiny-code"
PROMPTS = ROOT.parent / "shared" / "prompts" / "dev.jsonl"


def _per_row(f: torch.Tensor, qmax: float, cast) -> torch.Tensor:
    scale = f.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / qmax
    return cast(f / scale).float() * scale


ROUNDINGS = {
    "fp32 (exact)": lambda f: f,
    "bf16": lambda f: f.to(torch.bfloat16).float(),
    "fp16": lambda f: f.to(torch.float16).float(),
    "fp8 e4m3, scale per row": lambda f: _per_row(f, 448.0, lambda x: x.to(torch.float8_e4m3fn)),
    "int8, scale per row": lambda f: _per_row(f, 127.0, lambda x: x.round().clamp(-127, 127).to(torch.int8)),
}


class RoundedFeatures:
    """The target engine, its outputs' features rounded by `rounding`."""

    def __init__(self, engine, rounding):
        self.engine, self.rounding = engine, rounding

    def _round(self, outputs):
        for out in outputs:
            if out.features is not None:
                out.features = self.rounding(out.features.float()).to(out.features.dtype)
        return outputs

    def prefill(self, inputs):
        return self._round(self.engine.prefill(inputs))

    def verify(self, inputs, **kwargs):
        return self._round(self.engine.verify(inputs, **kwargs))

    def __getattr__(self, name):
        return getattr(self.engine, name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=30)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args(argv)
    tok = load_tokenizer(TINY / "target")
    texts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()][: args.limit]
    prompts = [tok.encode(t)[-256:] for t in texts]
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    opts = EngineOptions(num_pages=4096, max_batch_size=16)
    target = build_target(str(TINY / "target"), opts)
    plain = [r.tokens for r in generate(target, None, prompts, params, 16)]
    for head in ("draft", "draft-eagle3"):
        draft = build_draft(str(TINY / head), str(TINY / "target"), SpecConfig(5, 1, 5), opts, target.max_context)
        for name, rounding in ROUNDINGS.items():
            results = generate(RoundedFeatures(target, rounding), draft, prompts, params, 16)
            steps = sum(r.num_verify_steps for r in results)
            tau = sum(len(r.tokens) - 1 for r in results) / max(steps, 1)
            same = sum(r.tokens == t for r, t in zip(results, plain, strict=True))
            print(json.dumps({"head": head, "features": name, "tau": round(tau, 3), "verify_steps": steps,
                              "outputs_equal_plain": f"{same}/{len(prompts)}"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
