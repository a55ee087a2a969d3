"""Several plain decode steps in one call: `verify(inputs, plain_steps=k)` with empty trees commits up to k tokens
per request, one target step after another, and returns them as one output per request (a feature row per token).

The scheduler asks for `PLAIN_STEPS` when the adaptive policy decodes plainly, so a remote target answers with one
Verify RPC per k tokens instead of one per token: through the services a plain step otherwise pays a round trip
(~1.5-2 ms) that the target's own `Generate` never pays. The tokens are exactly those of k single steps.
"""

from __future__ import annotations

import torch

from specdec.engine.requests import RUNNING, VerifyInput, VerifyOutput, kept_feature_rows
from specdec.errors import InvalidInput

PLAIN_STEPS = 4  # tokens per request the scheduler asks for in one plain call (a request arriving meanwhile
#                   joins after it: up to 3 more steps of waiting than with one step per call)
MAX_PLAIN_STEPS = 64  # the most a caller may ask for in one call


def check_plain_steps(inputs: list[VerifyInput], steps: int, feature_rows: int = 0) -> None:
    """A Verify call's plain-step count (and its feature-row count: 0 = all) is one it can run."""
    if feature_rows < 0:
        raise InvalidInput(f"feature_rows {feature_rows} is negative (0: every token's features)")
    if not 1 <= steps <= MAX_PLAIN_STEPS:
        raise InvalidInput(f"plain_steps {steps} outside [1, {MAX_PLAIN_STEPS}]")
    if steps > 1 and any(inp.draft_tokens for inp in inputs):
        raise InvalidInput("plain_steps > 1 needs empty trees (no draft tokens)")


def run_plain_steps(run_chunk, inputs: list[VerifyInput], steps: int, limits=None) -> list[VerifyOutput]:
    """`steps` plain decode steps in chunks: `run_chunk(live, k)` runs k steps of the live requests (empty trees)
    and returns one output per request. `limits(request_id)` -> (room, wanted): the most steps the request's
    pages may take in one chunk, and the tokens it may still generate; a chunk runs what is left of `steps`, no
    more than any live request's room and no more than the most any of them wants (steps past a request's
    wanted tokens are computed with the batch's and dropped). None: chunks of one step. A request that
    finishes stops there. Outputs in input order: the tokens of all its steps, their feature rows, the last
    finish reason."""
    done: dict[str, list[VerifyOutput]] = {inp.request_id: [] for inp in inputs}
    live, left = list(inputs), steps
    while live and left:
        k = 1
        if limits is not None:
            bounds = [limits(inp.request_id) for inp in live]
            k = max(1, min(left, min(room for room, _ in bounds), max(wanted for _, wanted in bounds)))
        for out in run_chunk(live, k):
            done[out.request_id].append(out)
        left -= k
        live = [VerifyInput(rid, [], []) for rid, outs in done.items() if outs[-1].finish_reason == RUNNING]
    return [_merge(done[inp.request_id]) for inp in inputs]


def last_feature_rows(outputs: list[VerifyOutput], rows: int) -> list[VerifyOutput]:
    """Each output keeps the features of its last `rows` tokens only (0: all of them); views, no copies."""
    if not rows:
        return outputs
    for out in outputs:
        if out.features is not None:
            n = out.features.shape[0]
            if n > rows:  # (a plain chunk already cut its running requests' rows: no slice per request)
                out.features = out.features[n - kept_feature_rows(n, rows) :]
    return outputs


def split_features(steps: list[list], request: int, rows: int):
    """A request's feature rows from a chunk's per-step batch features (`steps[i][request]`: step i's row, or
    None when no features), its first `rows` of them. # [rows, feature_size] or None"""
    feats = [step[request] for step in steps[:rows]]
    return None if any(f is None for f in feats) else torch.cat(feats)


def step_features_into(chunk, step: int, steps: int, layers: tuple[int, ...], hidden, aux: dict, batch: int):
    """Copy one plain step's features (row r of the step is request r's: the final hidden state, or the
    concatenated inputs of the draft's `layers`) into `chunk[:, step]`, allocating `chunk` [batch, steps,
    feature_size] at the first step. One copy per layer per step, no gather: the step's outputs may be a CUDA
    graph's buffers, which the next step overwrites. Returns `chunk`."""
    parts = [hidden[:batch]] if not layers else [aux[i][:batch] for i in layers]
    if chunk is None:
        width = sum(p.shape[-1] for p in parts)
        chunk = torch.empty(batch, steps, width, dtype=parts[0].dtype, device=parts[0].device)
    start = 0
    for part in parts:
        chunk[:, step, start : start + part.shape[-1]].copy_(part)
        start += part.shape[-1]
    return chunk


def _merge(outs: list[VerifyOutput]) -> VerifyOutput:
    if len(outs) == 1:
        return outs[0]
    feats = [o.features for o in outs]
    return VerifyOutput(outs[0].request_id, [t for o in outs for t in o.tokens], 0,
                        None if any(f is None for f in feats) else torch.cat(feats), outs[-1].finish_reason)
