"""RMSNorm, optionally fused with the residual add before it, as one kernel per row.

Same arithmetic as `RMSNorm.forward` (HF): the sum x + residual is rounded to the input dtype, normalised in
float32, cast back, then multiplied by the weight and rounded again; only the order of the row's sum of squares
may differ from torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels import on_device
from specdec.kernels.pdl import pdl_enter, pdl_options


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, x_stride, res_stride, n, eps,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * res_stride + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=m)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x, residual: [rows, n] (last dim contiguous), weight: [n], all one dtype.
    Returns normed [rows, n], or (normed, x + residual) when residual is given."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out) if residual is not None else out
    if rows:
        block = triton.next_power_of_2(n)
        with on_device(x):
            _rmsnorm_kernel[(rows,)](
                x, residual if residual is not None else x, weight, out, summed, x.stride(0),
                residual.stride(0) if residual is not None else 0, n, eps,
                HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)), **pdl_options(x),
            )
    return out if residual is None else (out, summed)
