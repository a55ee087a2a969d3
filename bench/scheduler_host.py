"""Host (Python) work of the scheduler around one plain call of a running batch, target and draft stubbed: what
a draft and a policy add to a plain call (the policy's choice and record, the near-limit test, each request's
`_hold` of its last token's features) against plain decoding without a draft.

    python bench/scheduler_host.py --batch-size 128 --calls 200

In-process the GPU waits while this runs (a call's landing, then the next launch), so it bounds what a plain call
of `auto` can cost more than the target's own plain decoding. The stub target's work (building its outputs) is
timed with it and is the same in both rows.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specdec.engine.adaptive import SpeculationPolicy, budget_menu  # noqa: E402
from specdec.engine.requests import RUNNING, PrefillOutput, VerifyOutput  # noqa: E402
from specdec.engine.scheduler import Scheduler  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402


class StubTarget:
    """Answers at once: every plain call commits `plain_steps` tokens per request, with a feature row each."""

    batches_prefill = True

    def prefill(self, inputs):
        return [PrefillOutput(i.request_id, 7, torch.zeros(1, 8), RUNNING) for i in inputs]

    def verify(self, inputs, plain_steps=1, feature_rows=0):
        return [VerifyOutput(i.request_id, [5] * plain_steps, 0, torch.zeros(max(1, feature_rows), 8), RUNNING)
                for i in inputs]

    def release(self, rid):
        pass


class StubDraft:
    """The draft calls a plain call makes: skip (`Scheduler._hold`), release; and admission's add and extend."""

    class spec:
        num_steps, num_draft_tokens, topk = 6, 6, 1

    def __init__(self):
        self.requests = {}

    def add(self, rid, max_tokens):
        self.requests[rid] = 0

    def skip(self, rid, n):
        self.requests[rid] += n

    def release(self, rid):
        self.requests.pop(rid, None)

    def extend(self, items):
        pass

    def settle(self):
        pass


class PlainPolicy(SpeculationPolicy):
    """A policy that has settled on plain decoding (it still records every call)."""

    def choose(self, batch_size):
        return 0


def ms_per_call(batch: int, calls: int, with_draft: bool) -> float:
    policy = PlainPolicy(budget_menu(6)) if with_draft else None
    sched = Scheduler(StubTarget(), StubDraft() if with_draft else None, 1 << 20, batch, policy=policy)
    for i in range(batch):
        sched.add(f"r{i}", list(range(256)), SamplingParams(max_new_tokens=1 << 19, ignore_eos=True))
    sched.step()  # admission and the first call
    t0 = time.perf_counter()
    for _ in range(calls):
        sched.step()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    for with_draft in (False, True):
        rows = [ms_per_call(args.batch_size, args.calls, with_draft) for _ in range(3)]
        print(f"{'draft + policy' if with_draft else 'no draft      '}  {min(rows):.3f} ms per plain call "
              f"({args.batch_size} requests, best of 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
