"""Tree verification: which draft nodes the target accepts, and the bonus token after them.

Accepted tokens: the longest root-to-node path the target agrees with. Bonus token: the target's own choice after
the last accepted node. Greedy walks children matching the target argmax. Stochastic verification is tree
speculative sampling with deterministic (top-k chosen) draft tokens: at a node with target distribution p, try
the children in order; child token x is accepted with probability p(x); on rejection p(x) is zeroed and p
renormalised (the residual), and the next sibling is tried. If every child is rejected the bonus is sampled from
the residual. Each emitted token is then distributed exactly as the target's (filtered) distribution.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from specdec.sampling import sample, uniform
from specdec.tree import children_lists


@dataclass(frozen=True)
class Verdict:
    accepted: list[int]  # tree indices (1-based, root = 0) of accepted draft nodes, root to leaf
    bonus: int  # token id


def verify_greedy(tokens: list[int], parents: list[int], target_argmax: list[int]) -> Verdict:
    """tokens: [n] draft tokens; target_argmax: [n+1] target argmax at root and each node (tree index order)."""
    children = children_lists(parents)
    node, accepted = 0, []
    while True:
        want = target_argmax[node]
        nxt = next((c for c in children[node] if tokens[c - 1] == want), None)
        if nxt is None:
            return Verdict(accepted, want)
        accepted.append(nxt)
        node = nxt


def verify_stochastic(
    tokens: list[int], parents: list[int], probs: torch.Tensor, gen: torch.Generator
) -> Verdict:
    """probs: [n+1, vocab] target probabilities (after temperature/top-k/top-p/min-p) in tree index order."""
    children = children_lists(parents)
    node, accepted = 0, []
    while True:
        p = probs[node].double()
        nxt = None
        for child in children[node]:
            x = tokens[child - 1]
            px = p[x].item()
            if px > 0 and uniform(gen) < px:
                nxt = child
                break
            if px > 0:
                p = p.clone()
                p[x] = 0.0
                p = p / p.sum()
        if nxt is None:
            return Verdict(accepted, sample(p, gen))
        accepted.append(nxt)
        node = nxt


def verify_simulated(
    tokens: list[int], parents: list[int], target_argmax: list[int], mean_accept_len: float, rng: random.Random
) -> Verdict:
    """BENCHMARKING ONLY (`--simulate-accept-len`): the output is NOT the target's.

    Accepts a Binomial(depth, p) number of nodes along the first-child chain, p chosen so that tokens per step
    (accepted + bonus) average `mean_accept_len` (capped by the chain depth); the bonus is the target's argmax
    there, so the work done per step is the real one. `rng`: Python's generator, not a torch one (a torch draw
    per request cost ~30 us on the host, 2-4 ms a verify of 128 requests that a real verify does not pay).
    """
    children = children_lists(parents)
    chain, node = [], 0
    while children[node]:
        node = children[node][0]
        chain.append(node)
    if not chain:
        return Verdict([], target_argmax[0])
    p = min(1.0, max(0.0, (mean_accept_len - 1.0) / len(chain)))
    m = sum(rng.random() < p for _ in chain)
    accepted = chain[:m]
    return Verdict(accepted, target_argmax[accepted[-1] if accepted else 0])
