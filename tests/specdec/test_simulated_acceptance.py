"""`--simulate-accept-len X` (benchmarking only): the target accepts a simulated number of draft tokens per step
whose mean (bonus included) is X, reproducibly for a seeded request, whatever the target's argmax says."""

from __future__ import annotations

import random

from repo_paths import TINY

from specdec.engine.factory import EngineOptions, build_target
from specdec.engine.requests import PrefillInput, VerifyInput
from specdec.sampling_params import SamplingParams
from specdec.verify import verify_simulated

CHAIN = list(range(-1, 5))  # parents of a chain of 6 draft tokens


def test_simulated_steps_average_the_asked_length_along_the_chain():
    for mean in (1.0, 3.0, 5.0, 7.0):
        rng = random.Random(0)
        steps = [verify_simulated([9] * 6, CHAIN, list(range(100, 107)), mean, rng) for _ in range(4000)]
        lengths = [len(v.accepted) + 1 for v in steps]
        assert all(v.accepted == list(range(1, len(v.accepted) + 1)) for v in steps)  # a prefix of the chain
        # the bonus is the target's argmax after the last accepted node
        assert all(v.bonus == 100 + (v.accepted[-1] if v.accepted else 0) for v in steps)
        assert abs(sum(lengths) / len(lengths) - mean) < 0.05, mean  # binomial sd ~0.02 at 4000 draws
    assert len(verify_simulated([], [], [42], 5.0, random.Random(0)).accepted) == 0  # a plain step: bonus only


def _run(seed: int) -> list[int]:
    target = build_target(str(TINY / "target"), EngineOptions(num_pages=256, max_batch_size=2,
                                                             simulate_accept_len=4.0))
    params = SamplingParams(max_new_tokens=200, ignore_eos=True, seed=seed)
    target.prefill([PrefillInput("a", [5, 6, 7, 8], params)])
    accepted = []
    for _ in range(12):
        out = target.verify([VerifyInput("a", [11, 12, 13, 14, 15], list(range(-1, 4)))])[0]
        accepted.append(out.num_accepted_drafts)
    return accepted


def test_a_seeded_request_draws_the_same_simulated_lengths_every_run():
    first = _run(7)
    assert first == _run(7)
    assert len(set(first)) > 1  # the draws vary from step to step
