"""Where a request stops inside a run of newly committed tokens."""

from __future__ import annotations

from specdec.engine.requests import LENGTH, RUNNING, STOP
from specdec.sampling_params import SamplingParams


def length_room(params: SamplingParams, num_generated: int, total_len: int, max_context: int) -> int:
    """Tokens a request may still commit before a length limit ends it (its max_new_tokens, the context), from
    `num_generated` tokens generated and `total_len` (prompt + generated) so far."""
    return min(params.max_new_tokens - num_generated, max_context - total_len)


def cut_at_finish(
    new_tokens: list[int],
    num_generated: int,
    total_len: int,
    params: SamplingParams,
    eos_ids: tuple[int, ...],
    max_context: int,
) -> tuple[list[int], str]:
    """Keep tokens up to and including the finishing one; return them and the finish reason.

    num_generated: tokens already generated before `new_tokens`; total_len: prompt + generated so far.
    A stop/EOS token is kept (the caller may hide it); nothing after it is.
    """
    # per committed run of every request of every step (128 requests, 4-step plain calls: ~5 us each as a loop that
    # built a set and tested both limits per token): the length limit is one index, stops a scan up to it
    limit = max(1, length_room(params, num_generated, total_len, max_context))
    stops = params.stop_token_ids if params.ignore_eos else (*params.stop_token_ids, *eos_ids)
    if stops:
        if len(stops) > 8:
            stops = set(stops)
        for i, tok in enumerate(new_tokens[:limit]):
            if tok in stops:
                return new_tokens[: i + 1], STOP
    if len(new_tokens) >= limit:
        return new_tokens[:limit], LENGTH
    return new_tokens, RUNNING
