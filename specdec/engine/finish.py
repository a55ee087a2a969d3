"""Where a request stops inside a run of newly committed tokens."""

from __future__ import annotations

from specdec.engine.requests import LENGTH, RUNNING, STOP
from specdec.sampling_params import SamplingParams


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
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids.update(eos_ids)
    for i, tok in enumerate(new_tokens):
        if tok in stop_ids:
            return new_tokens[: i + 1], STOP
        if num_generated + i + 1 >= params.max_new_tokens or total_len + i + 1 >= max_context:
            return new_tokens[: i + 1], LENGTH
    return new_tokens, RUNNING
