"""Fused GPU kernels (Triton) for the small per-layer operations of a decoder forward.

At batch 1 an 8B forward is ~130 weight-bound matmuls plus, unfused, ~900 tiny element-wise kernels (norm casts,
rotary halves, residual adds, SiLU) that cost more GPU time than the attention itself. Each kernel here replaces
one such group with one launch and keeps the eager torch rounding where it can (see each module); `linear`
sends one-row projections (batch-1 decode, a draft's chain steps) to `gemv.py` and those of a few rows (a chain
verify at batch 1, a few requests' decode) to `skinny.py`. Used on CUDA tensors when Triton is importable;
`SPECDEC_FUSED_KERNELS=0` turns them all off (the torch code paths are the reference and what CPUs run),
`SPECDEC_GEMV=0` only the projection kernels, `SPECDEC_SKINNY=0` only the few-rows one, `SPECDEC_DECODE_KERNEL=0`
the Triton decode attention of plain decode, chain and tree verifies at small batch (flashinfer's then),
`SPECDEC_TREE_KERNEL=0` only its tree verifies, `SPECDEC_PDL=0`
their programmatic dependent launch (`kernels/pdl.py`). `tests/specdec/test_kernels.py` checks them against the
torch code on CPU through Triton's interpreter, `tests/gpu` on the GPU.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch


@functools.cache
def _triton_ok() -> bool:
    if os.environ.get("SPECDEC_FUSED_KERNELS", "1") == "0":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _gemv_on() -> bool:
    return os.environ.get("SPECDEC_GEMV", "1") != "0"


@functools.cache
def _skinny_on() -> bool:
    return os.environ.get("SPECDEC_SKINNY", "1") != "0"


@functools.cache
def decode_kernel_on() -> bool:
    return os.environ.get("SPECDEC_DECODE_KERNEL", "1") != "0"


@functools.cache
def tree_kernel_on() -> bool:
    return os.environ.get("SPECDEC_TREE_KERNEL", "1") != "0"


def on_device(t: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's (a service on cuda:1)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def interpreted() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (TRITON_INTERPRET=1: the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def attention_fused(head_dim: int) -> bool:
    """Whether the attention kernels (rotary + K/V write, the paged decode) take this head size: a power of two
    from 16 (their tiles span a whole head; 64 and 128 are the Llama family's)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def fused(t: torch.Tensor) -> bool:
    """Whether the fused kernels run for this tensor (CUDA, or any device under TRITON_INTERPRET=1)."""
    if t.is_cuda or interpreted():
        return _triton_ok()
    return False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), as `torch.nn.functional.linear`; without a bias, one 16-bit row goes through
    `gemv.py` and 2 to `skinny.MAX_ROWS` rows through `skinny.py`."""
    if bias is None and x.dim() == 2 and fused(x) and _gemv_on():
        rows = x.shape[0]
        if rows == 1:
            from specdec.kernels.gemv import applies, gemv

            if applies(x, weight):
                return gemv(x, weight)
        else:
            from specdec.kernels.skinny import MAX_ROWS, applies, skinny_linear

            if 2 <= rows <= MAX_ROWS and _skinny_on() and applies(x, weight):
                return skinny_linear(x, weight)
    return torch.nn.functional.linear(x, weight, bias)
