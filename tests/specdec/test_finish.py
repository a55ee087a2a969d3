"""Where a request stops inside a run of new tokens (`cut_at_finish`): the first stop or EOS token, kept, or the
token at which max_new_tokens or the context runs out, whichever comes first; a stop wins at the same token."""

from __future__ import annotations

import random

from specdec.engine.finish import cut_at_finish
from specdec.engine.requests import LENGTH, RUNNING, STOP
from specdec.sampling_params import SamplingParams


def _token_by_token(new_tokens, num_generated, total_len, params, eos_ids, max_context):
    """The definition, one token at a time."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
    for i, tok in enumerate(new_tokens):
        if tok in stops:
            return new_tokens[: i + 1], STOP
        if num_generated + i + 1 >= params.max_new_tokens or total_len + i + 1 >= max_context:
            return new_tokens[: i + 1], LENGTH
    return new_tokens, RUNNING


def test_cut_at_finish_matches_the_token_by_token_definition():
    rng = random.Random(0)
    for _ in range(5000):
        stop_ids = rng.sample(range(12), rng.choice([0, 1, 2, 12]))
        params = SamplingParams(max_new_tokens=rng.randint(1, 12), stop_token_ids=stop_ids,
                                ignore_eos=rng.random() < 0.5)
        generated = rng.randint(0, 14)
        total = generated + rng.randint(1, 20)
        args = ([rng.randrange(14) for _ in range(rng.randint(0, 9))], generated, total, params,
                (13,) if rng.random() < 0.7 else (), rng.randint(total - 2, total + 12))
        assert cut_at_finish(*args) == _token_by_token(*args), args


def test_a_stop_token_at_the_length_limit_reads_as_a_stop():
    params = SamplingParams(max_new_tokens=3, stop_token_ids=[7])
    assert cut_at_finish([1, 2, 7, 4], 0, 10, params, (), 100) == ([1, 2, 7], STOP)
    assert cut_at_finish([1, 2, 5, 4], 0, 10, params, (), 100) == ([1, 2, 5], LENGTH)
    assert cut_at_finish([1, 2], 0, 10, params, (), 100) == ([1, 2], RUNNING)
    assert cut_at_finish([], 0, 10, params, (), 100) == ([], RUNNING)
