"""Host (Python) work of one TargetEngine.verify step, with the model and attention stubbed out, so only the
engine's own bookkeeping is timed: page tables, tree masks, positions, acceptance, KV compaction, commits.

    python bench/host_overhead.py --batch-size 128 --context 1024

On a GPU this time is spent while the GPU waits (the step's kernels are launched after it), so it bounds how fast
a large batch can step. Runs on CPU; the tiny pair's config gives the shapes.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.engine.factory import EngineOptions, build_target  # noqa: E402
from specdec.engine.requests import PrefillInput, VerifyInput  # noqa: E402
from specdec.models.llama import TargetOutput  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402


class NoAttention:
    def plan(self, batch):
        return batch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    b, ctx = args.batch_size, args.context
    pages = b * (-(-(ctx + 300) // 16) + 2)
    target = build_target(str(ROOT / "models" / "tiny-code" / "target"),
                          EngineOptions(num_pages=pages, max_batch_size=b))
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    target.prefill([PrefillInput(f"r{i}", list(range(100, 100 + ctx)), params) for i in range(b)])
    hidden = target.cfg.hidden_size
    target.backend = NoAttention()
    target.model.forward = lambda ids, *a, **k: TargetOutput(torch.zeros(ids.shape[0], hidden), None)
    target.model.compute_logits = lambda h: torch.zeros(h.shape[0], 8)
    for label, tokens, parents in (("plain decode", [], []), ("chain of 6", [5] * 6, list(range(-1, 5))),
                                   ("tree of 16 (topk 4)", [5] * 16, [-1] * 4 + [i // 4 for i in range(12)])):
        inputs = [VerifyInput(f"r{i}", tokens, parents) for i in range(b)]
        target.verify(inputs)
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            target.verify(inputs)  # zero logits: nothing accepted, one token committed per request and step
        ms = (time.perf_counter() - t0) / args.repeats * 1e3
        print(f"{label}: {ms:.2f} ms host per verify step (batch {b}, context {ctx})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
