"""The few-rows kernel (`specdec/kernels/skinny.py`) with K split in a given number of parts, for
`bench/gemv_micro.py --split`'s sweep."""

from __future__ import annotations

import torch

from specdec.kernels.skinny import _skinny_kernel

_COUNTS: dict = {}


def split_linear(x, w, out, block_n, block_k, warps, stages, split):
    m, k = x.shape
    n = w.shape[0]
    key = (x.device, n // block_n)
    if key not in _COUNTS:
        _COUNTS[key] = torch.zeros(n // block_n, dtype=torch.int32, device=x.device)
    part = torch.empty((split, 16, n), dtype=torch.float32, device=x.device)
    _skinny_kernel[(n // block_n, split)](x, w, out, part, _COUNTS[key], m, n, k, x.stride(0), w.stride(0),
                                          out.stride(0), BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
                                          num_warps=warps, num_stages=stages, PDL=False, EARLY=False)
