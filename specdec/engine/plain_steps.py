"""Several plain decode steps in one call: `verify(inputs, plain_steps=k)` with empty trees commits up to k tokens
per request, one target step after another, and returns them as one output per request (a feature row per token).

The scheduler asks for `PLAIN_STEPS` when the adaptive policy decodes plainly, so a remote target answers with one
Verify RPC per k tokens instead of one per token: through the services a plain step otherwise pays a round trip
(~1.5-2 ms) that the target's own `Generate` never pays. The tokens are exactly those of k single steps.
"""

from __future__ import annotations

import torch

from specdec.engine.requests import RUNNING, VerifyInput, VerifyOutput
from specdec.errors import InvalidInput

PLAIN_STEPS = 4  # tokens per request the scheduler asks for in one plain call (a request arriving meanwhile
#                   joins after it: up to 3 more steps of waiting than with one step per call)
MAX_PLAIN_STEPS = 64  # the most a caller may ask for in one call


def check_plain_steps(inputs: list[VerifyInput], steps: int) -> None:
    if not 1 <= steps <= MAX_PLAIN_STEPS:
        raise InvalidInput(f"plain_steps {steps} outside [1, {MAX_PLAIN_STEPS}]")
    if steps > 1 and any(inp.draft_tokens for inp in inputs):
        raise InvalidInput("plain_steps > 1 needs empty trees (no draft tokens)")


def run_plain_steps(verify_once, inputs: list[VerifyInput], steps: int) -> list[VerifyOutput]:
    """`steps` calls of `verify_once` (one target step over empty trees each); a request that finishes stops
    there. Outputs in input order: the tokens of all its steps, their feature rows, the last finish reason."""
    done: dict[str, list[VerifyOutput]] = {inp.request_id: [] for inp in inputs}
    live = list(inputs)
    for _ in range(steps):
        for out in verify_once(live):
            done[out.request_id].append(out)
        live = [VerifyInput(rid, [], []) for rid, outs in done.items() if outs[-1].finish_reason == RUNNING]
        if not live:
            break
    return [_merge(done[inp.request_id]) for inp in inputs]


def _merge(outs: list[VerifyOutput]) -> VerifyOutput:
    if len(outs) == 1:
        return outs[0]
    feats = [o.features for o in outs]
    return VerifyOutput(outs[0].request_id, [t for o in outs for t in o.tokens], 0,
                        None if any(f is None for f in feats) else torch.cat(feats), outs[-1].finish_reason)
