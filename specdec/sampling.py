"""Target-side probability processing (temperature, top-k, top-p, min-p) and seeded sampling.

Exact torch implementations; rows whose filters are off skip the work.
"""

from __future__ import annotations

import torch

from specdec.sampling_params import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator:
    """A per-request CPU generator: a seeded request's draws do not depend on what else runs in the batch (its text
    may, by floating-point rounding: a batch's logits can differ from one request's alone in their last bits, which
    flips a draw within ~1e-6 of the boundary between two tokens; QA saw it once)."""
    gen = torch.Generator(device="cpu")
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


MIN_TEMPERATURE = torch.finfo(torch.float32).tiny  # 1.18e-38


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] float32 logits -> [n, vocab] float32 probabilities after all of the request's filters."""
    logits = logits.float()
    # shifted by the row's max before the division: a tiny temperature (1e-39) sends the top logit to 0 and the
    # rest to -inf (near-greedy), where logits / temperature overflowed to inf and the softmax to NaN; and no
    # smaller than float32's least normal number, which behaves the same: a temperature that rounds to 0 in float32
    # (1e-50) divided the top logit's 0 by 0 and sampled a NaN distribution (the same junk token every time)
    temperature = max(params.temperature, MIN_TEMPERATURE)
    probs = torch.softmax((logits - logits.max(dim=-1, keepdim=True).values) / temperature, dim=-1)
    if params.top_k > 0 and params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k, dim=-1).values[:, -1:]  # [n, 1]
        probs = torch.where(probs >= kth, probs, 0.0)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(dim=-1, keepdim=True).values, probs, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one)."""
    probs = probs / probs.sum(dim=-1, keepdim=True)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly more likely tokens
    keep_sorted = mass_before < top_p
    keep_sorted[..., 0] = True  # the most likely token, even where top_p rounds to 0 in float32 (1e-46)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return torch.where(keep, probs, 0.0)


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One token from a [vocab] distribution (inverse CDF with one uniform draw from `gen`)."""
    u = torch.rand((), generator=gen, dtype=torch.float64).item()
    cdf = torch.cumsum(probs.double(), dim=0)
    target = torch.tensor([u * cdf[-1].item()], dtype=torch.float64, device=cdf.device)
    idx = int(torch.searchsorted(cdf, target).item())
    idx = min(idx, probs.shape[0] - 1)
    while probs[idx] <= 0 and idx > 0:  # never land on a zero-probability token through rounding
        idx -= 1
    return idx


def uniform(gen: torch.Generator) -> float:
    return torch.rand((), generator=gen, dtype=torch.float64).item()
