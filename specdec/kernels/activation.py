"""SiLU(gate) * up over the fused gate_up projection, one kernel (torch rounding: SiLU rounded to the dtype,
then the product rounded)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels import on_device
from specdec.kernels.pdl import pdl_enter, pdl_options

BLOCK = 512


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, gu_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < inter
    g = tl.load(gu_ptr + row * gu_stride + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * gu_stride + inter + cols, mask=m, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (s * u).to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 * inter] (gate first) -> [rows, inter]."""
    rows, two_inter = gate_up.shape
    inter = two_inter // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        with on_device(gate_up):
            _silu_mul_kernel[(rows, triton.cdiv(inter, BLOCK))](gate_up, out, inter, gate_up.stride(0), BLOCK=BLOCK,
                                                                   **pdl_options(gate_up))
    return out
