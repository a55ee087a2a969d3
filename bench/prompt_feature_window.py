"""What a prompt feature window costs the draft: tokens per speculative step when each prompt brings the features
of its last W tokens only (the draft skips the earlier ones, as `--prompt-feature-mb` makes a large admission do)
against whole prompts. In-process, shipped tiny pair, greedy, chain of 5, always speculating, one batch of dev
prompts (60.., held apart from the tests' range).

    python bench/prompt_feature_window.py [--draft draft|draft-eagle3] [--prompts 16] [--windows 1,16,32,64,128]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiny_pair import dev_prompts, tiny_pair  # noqa: E402

from specdec.engine.adaptive import FULL, SpeculationPolicy  # noqa: E402
from specdec.engine.generate import feature_layers_for  # noqa: E402
from specdec.engine.scheduler import Scheduler  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402


class Counting(SpeculationPolicy):
    """Always the whole chain; sums the tokens committed per request-step of the requests still running."""

    def __init__(self):
        super().__init__()
        self.committed, self.request_steps = 0, 0

    def choose(self, batch_size: int) -> int:
        return FULL

    def plain_leads(self, batch_size: int) -> bool:
        return False

    def record(self, batch_size, budget, tokens, seconds, steps=1, yielding=None, chosen_at=None,
               derived=None) -> None:
        if yielding:
            self.committed, self.request_steps = self.committed + tokens, self.request_steps + yielding


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", default="draft", help="draft (EAGLE-1) or draft-eagle3")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256, help="each prompt's last N tokens")
    ap.add_argument("--windows", default="1,16,32,64,128", help="prompt tokens whose features the draft gets")
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args(argv)
    target, draft = tiny_pair(args.draft, args.prompts)
    prompts = dev_prompts(args.prompts, args.prompt_tokens)
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    for window in [0] + [int(x) for x in args.windows.split(",")]:
        policy = Counting()
        sched = Scheduler(target, draft, target.max_context, len(prompts), feature_layers_for(draft), policy=policy,
                          prompt_feature_rows=window * len(prompts))
        sched._window = lambda wave, w=window: w  # exactly `window` (the scheduler's floor is 64 rows)
        for i, prompt in enumerate(prompts):
            sched.add(f"r{i}", prompt, params)
        while sched.has_work:
            sched.step()
        print(json.dumps({"draft": args.draft, "window": window or "whole prompt",
                          "tokens_per_step": round(policy.committed / policy.request_steps, 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
