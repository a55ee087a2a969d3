"""What skipping a plain stretch costs the draft: tokens per speculative step after a stretch of plain decoding,
when the draft caught up on every plain token (what the scheduler did before) vs when it skipped all but the last
(what it does: `Scheduler._hold`). In-process, shipped tiny pair, greedy, chain of 5, one batch of dev prompts:
speculation for the first calls, plain calls of 4 steps, speculation again.

    python bench/plain_stretch_skip.py [--draft draft|draft-eagle3] [--prompts 12] [--stretches 32,96]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_pair import dev_prompts, tiny_pair  # noqa: E402

from specdec.engine import scheduler as scheduler_module  # noqa: E402
from specdec.engine.adaptive import FULL, SpeculationPolicy  # noqa: E402
from specdec.engine.generate import feature_layers_for  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402

PLAIN_STEPS = 4


class Stretch(SpeculationPolicy):
    """Speculate for `before` calls, decode plainly for `plain` calls, then speculate. Records the tokens per
    request-step of the speculative calls after the stretch."""

    def __init__(self, before: int, plain: int):
        super().__init__()
        self.before, self.plain, self.calls, self.after = before, plain, 0, []

    def choose(self, batch_size: int) -> int:
        self.calls += 1
        return 0 if self.before < self.calls <= self.before + self.plain else FULL

    def record(self, batch_size, budget, tokens, seconds, steps=1, yielding=None, chosen_at=None,
               derived=None) -> None:
        if budget != 0 and self.calls > self.before + self.plain and yielding:
            self.after.append(tokens / yielding)


class CatchingUp(scheduler_module.Scheduler):
    """The draft follows every plain token (plain calls must then bring every feature row back)."""

    def _hold(self, state, tokens, features) -> None:
        state.backlog_tokens = state.backlog_tokens + tokens
        old = state.backlog_features
        state.backlog_features = features if old is None else torch.cat([old, features])


def _run(cls, target, draft, prompts, params, policy) -> None:
    sched = cls(target, draft, target.max_context, len(prompts), feature_layers_for(draft), policy=policy,
                plain_steps=PLAIN_STEPS)
    for i, prompt in enumerate(prompts):
        sched.add(f"r{i}", prompt, params)
    while sched.has_work:
        sched.step()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="draft", help="draft (EAGLE-1) or draft-eagle3")
    ap.add_argument("--prompts", type=int, default=12, help="dev prompts 60.. (held apart from the tests' range)")
    ap.add_argument("--stretches", default="32,96", help="plain tokens per request in the stretch")
    ap.add_argument("--new-tokens", type=int, default=256)
    args = ap.parse_args(argv)
    target, draft = tiny_pair(args.draft, args.prompts)
    prompts = dev_prompts(args.prompts, 200)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    for stretch in (int(x) for x in args.stretches.split(",")):
        row = {"draft": args.draft, "plain_tokens": stretch}
        for cls, rows, name in ((CatchingUp, 0, "caught_up"), (scheduler_module.Scheduler, 1, "skipped")):
            scheduler_module.PLAIN_FEATURE_ROWS = rows
            policy = Stretch(8, stretch // PLAIN_STEPS)
            _run(cls, target, draft, prompts, params, policy)
            row[f"tokens_per_step_{name}"] = round(sum(policy.after) / len(policy.after), 3)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
