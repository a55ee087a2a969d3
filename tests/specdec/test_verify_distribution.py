"""Stochastic tree verification reproduces the target distribution exactly (statistical test, fixed seeds).

A small vocab (6 tokens); the target distribution at every tree node is fixed. Each trial verifies the same
tree; the first emitted token must follow the root distribution, and given that the first emitted token is an
accepted child c, the second must follow c's distribution. Bounds: total-variation distance and a chi-square
test at p > 1e-4 for N = 20000 trials.
"""

from __future__ import annotations

import pytest
import torch

from specdec.sampling import target_probs
from specdec.sampling_params import SamplingParams
from specdec.verify import verify_stochastic

V = 6
N = 20000
CHI2_CRIT_5DOF = 25.7  # chi-square critical value, 5 degrees of freedom, p = 1e-4


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with zero target probability was emitted"
    exp = probs[keep] * n
    return (((counts[keep] - exp) ** 2) / exp).sum().item()


def _check(counts: torch.Tensor, probs: torch.Tensor) -> None:
    tv = 0.5 * (counts / counts.sum() - probs).abs().sum().item()
    assert tv < 0.02, tv
    dof = int((probs > 0).sum()) - 1
    crit = {5: CHI2_CRIT_5DOF, 4: 23.5, 3: 21.1, 2: 18.4, 1: 15.1}[dof] if dof > 0 else float("inf")
    assert _chi2(counts, probs) < crit


TREES = {
    "chain": ([2, 3, 1], [-1, 0, 1]),
    "tree": ([2, 4, 0, 5, 3], [-1, -1, 0, 0, 1]),
}
PARAMS = {
    "plain": SamplingParams(temperature=1.0),
    "temp-topk": SamplingParams(temperature=0.7, top_k=3),
    "topp-minp": SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05),
}


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("pname", list(PARAMS))
def test_emitted_tokens_follow_target_distribution(tree, pname):
    tokens, parents = TREES[tree]
    params = PARAMS[pname]
    gen = torch.Generator().manual_seed(1234)
    logits = torch.randn(len(tokens) + 1, V, generator=gen) * 1.5
    probs = target_probs(logits, params)
    first = torch.zeros(V)
    second = {c: torch.zeros(V) for c in range(1, len(tokens) + 1)}
    rng = torch.Generator().manual_seed(99)
    for _ in range(N):
        v = verify_stochastic(tokens, parents, probs, rng)
        emitted = [tokens[a - 1] for a in v.accepted] + [v.bonus]
        first[emitted[0]] += 1
        if v.accepted:
            second[v.accepted[0]][emitted[1]] += 1
    _check(first, probs[0].double().float())
    for child, counts in second.items():
        if counts.sum() > 2000:
            _check(counts, probs[child])


def test_top_k_top_p_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0, 0] == 1.0  # the top token alone has mass > 0.5
    p = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert (p[0] > 0).tolist() == [True, True, False, False, False, False]


def test_seeded_verification_is_reproducible():
    tokens, parents = TREES["tree"]
    probs = target_probs(torch.randn(6, V, generator=torch.Generator().manual_seed(3)), SamplingParams(1.0))
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(7)
        runs.append([verify_stochastic(tokens, parents, probs, g) for _ in range(50)])
    assert runs[0] == runs[1]


def test_extreme_but_valid_temperature_and_top_p_stay_near_greedy():
    """A temperature or top_p that float32 cannot hold (1e-39, 1e-46, 1e-50: inside the documented ranges) gives the
    most likely token's one-hot distribution, not NaN (which sampled the last vocabulary id every time)."""
    from specdec.sampling import target_probs

    logits = torch.tensor([[1.0, 3.5, -2.0, 3.0], [0.5, -1.0, 2.0, 1.9]])
    for params in (SamplingParams(temperature=1e-39), SamplingParams(temperature=1e-30),
                   SamplingParams(temperature=1e-50), SamplingParams(temperature=7e-46),  # 0 in float32
                   SamplingParams(temperature=1.0, top_p=1e-46), SamplingParams(temperature=1.0, top_p=1e-45),
                   SamplingParams(temperature=1e-39, top_p=1e-46, top_k=2, min_p=0.5)):
        probs = target_probs(logits, params)
        assert torch.isfinite(probs).all(), params
        assert probs.argmax(-1).tolist() == [1, 2] and torch.allclose(probs.max(-1).values, torch.ones(2)), params
    # ordinary settings are the plain softmax of logits / temperature
    assert torch.allclose(target_probs(logits, SamplingParams(temperature=0.7)), torch.softmax(logits / 0.7, -1))
