"""One row times a weight matrix (`x @ w.T` for x of one row), on the CUDA cores: the projections of a batch-1
decode step and of a draft's chain steps.

At one row a projection only streams its weight; cuBLAS picks tensor-core kernels tiled for 8 rows, some with a
split-K reduction after them (a second kernel), and reached 2.5-4.2 TB/s on the H200 over the 8B shape's five
projections, the 4096 x 4096 one the worst (`bench/gemv_micro.py`). Here each program reads `BLOCK_N` whole rows
of the weight in `BLOCK_K` chunks, multiplies them by x in float32 and sums each row once at the end: 3.0-4.5 TB/s
on the same shapes, one kernel each. Accumulation is float32 as in cuBLAS; only the order of the row's sum
differs, so results match torch's to the dtype's rounding (not bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels import on_device
from specdec.kernels.pdl import pdl_enter, projection_options


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr, EARLY: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if EARLY:  # the first chunk of the weight is read before the wait: no kernel writes a weight
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32)
        pdl_enter(PDL)
        acc += w * tl.load(x_ptr + offs_k).to(tl.float32)[None, :]
        w_ptrs += BLOCK_K
        start = BLOCK_K
    else:
        pdl_enter(PDL)
        start = 0
    for k0 in range(start, K, BLOCK_K):  # K is a multiple of BLOCK_K (see `config`)
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + k0 + offs_k).to(tl.float32)  # [BLOCK_K]
        acc += w * x[None, :]
        w_ptrs += BLOCK_K
    tl.store(out_ptr + offs_n, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_ok)


def config(n: int, k: int) -> tuple[int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an n x k weight, or None where this kernel does not apply.
    From `bench/gemv_micro.py` on the H200: 16 rows a program everywhere; wide matrices (the MLP's gate_up, lm_head)
    in 256-column chunks with 4 warps, the others in 512-column chunks with 8 warps; narrower chunks only where k
    needs them (the tiny model's 384). Sweeps put 8 rows a program within +-3% on some shapes and 15% behind on
    the 6144-row qkv with 8 warps, between two runs of noise that size: this is the setting measured end to end."""
    if n <= 0 or k <= 0:
        return None
    if n > 8192 and k % 256 == 0:
        return 16, 256, 4, 3
    for block_k in (512, 256, 128):
        if k % block_k == 0:
            return 16, block_k, 8, 4
    return None


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """For a one-row x (`kernels.linear` checks the rows): a contiguous 16-bit x against a contiguous weight of the
    same dtype and a shape `config` takes."""
    return (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.is_contiguous()
            and weight.is_contiguous() and weight.shape[1] == x.shape[1] and config(*weight.shape) is not None)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [1, k], weight: [n, k] (`applies`; a model's weight: with PDL the kernel may read its first chunk while
    the kernel before it still runs) -> [1, n] = x @ weight.T in x's dtype."""
    n, k = weight.shape
    block_n, block_k, warps, stages = config(n, k)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    with on_device(x):
        _gemv_kernel[(triton.cdiv(n, block_n),)](x, weight, out, n, k, weight.stride(0), BLOCK_N=block_n,
                                                  BLOCK_K=block_k, num_warps=warps, num_stages=stages,
                                                  **projection_options(x))
    return out
