"""A few rows times a weight matrix (`x @ w.T` for x of 2 to `MAX_ROWS` rows) on the tensor cores: a chain verify's
root and drafts at batch 1, plain decode of a few requests, the draft's extend over a few tokens.

At 7-9 rows cuBLAS streamed the 8B shape's 4096 x 4096 projection at 2.5 TB/s on the H200 (8- or 16-row-wide tiles
of x, some with a split-K reduction kernel after them; `bench/gemv_micro.py`). Here the product is computed
transposed, out^T = w @ x^T: the weight's rows are the wide side of the MMA (64 or 128 a program: Hopper's
warpgroup MMA) and x^T, padded to 16 columns, the narrow side; each program streams its rows of the weight once in
`BLOCK_K` chunks, one kernel a projection: 3.1 TB/s there (+23-25%), +2-3% on the MLP's down projection, +9% on an
EAGLE-3 head's fc, within -8..+3% on the others. Launched with PDL (`kernels/pdl.py`) it reads its first weight
chunk before it waits for the kernel before it, as the one-row kernel does: a batch-1 chain-of-8 verify graph
replays 2.4% faster than with cuBLAS, 4 requests decode 4.6% faster (`bench/pdl_ab.py`). Sums are float32 in K
order, so a row's result does not depend on the other rows of x (cuBLAS may pick another kernel for another row
count); it equals torch's to the dtype's rounding, not bit for bit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from specdec.kernels import on_device
from specdec.kernels.pdl import pdl_enter, projection_options

MAX_ROWS = 16  # more rows go to torch's linear (cuBLAS); `skinny_linear` itself takes up to 32
STAGE_BYTES = 160 * 1024  # the most shared memory the pipeline's stages may take (the H200 gives a block 227 KB)
SPARE_BYTES = 64 * 1024  # shared memory left to the compiler's own use on a GPU that gives a block less
FALLBACK_SHARED = 99 * 1024  # a block's shared memory where the driver does not say (the smallest of recent GPUs)
MIN_CAPABILITY = (8, 0)  # older GPUs (no bfloat16 tensor-core MMA) keep cuBLAS


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, K, stride_xm, stride_wn, stride_om, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # N is a multiple of BLOCK_N (see `config`)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]: x^T
    m_ok = offs_m[None, :] < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    # "ieee": float32 inputs (the GPU checks) multiply in full precision, not TF32; 16-bit inputs ignore it
    if EARLY:  # the first chunk of the weight is read before the wait: no kernel writes a weight
        w = tl.load(w_ptrs)
        pdl_enter(PDL)
        acc = tl.dot(w, tl.load(x_ptrs, mask=m_ok, other=0.0), acc, input_precision="ieee")
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        start = BLOCK_K
    else:
        pdl_enter(PDL)
        start = 0
    for _ in range(start, K, BLOCK_K):  # K is a multiple of BLOCK_K
        acc = tl.dot(tl.load(w_ptrs), tl.load(x_ptrs, mask=m_ok, other=0.0), acc, input_precision="ieee")
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok)


def config(n: int, k: int) -> tuple[int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an n x k weight, or None where this kernel does not apply (torch's
    linear then). From `bench/gemv_micro.py` on the H200 at 7 and 9 rows: wide matrices (the MLP's gate_up, lm_head)
    128 weight rows a program in 128-column chunks, 3 stages; long rows (k > 8192: down) 64 rows in 256-column
    chunks, 4 stages; the others 64 rows in 128-column chunks, 6 stages; 4 warps. Alone, the wide ones and qkv
    streamed 1-8% slower than cuBLAS on some machines; inside a forward's graph (PDL) sending them here too measured
    faster than keeping them on cuBLAS (`bench/pdl_ab.py`, session 19), so every width comes here."""
    if n <= 0 or k <= 0:
        return None
    if n > 8192 and n % 128 == 0 and k % 128 == 0:
        return 128, 128, 4, 3
    if n % 64:
        return None
    if k > 8192 and k % 256 == 0:
        return 64, 256, 4, 4
    for block_k in (128, 64):
        if k % block_k == 0:
            return 64, block_k, 4, 6
    return None


@functools.cache
def capable(device_index: int) -> bool:
    """Whether the GPU is one this kernel runs on (compute capability `MIN_CAPABILITY` or later)."""
    return torch.cuda.get_device_capability(device_index) >= MIN_CAPABILITY


@functools.cache
def shared_bytes(device_index: int) -> int:
    """The shared memory a block may use on this GPU (Triton's device properties)."""
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - a driver or Triton that does not say: assume a small GPU
        return FALLBACK_SHARED


def _stages(x: torch.Tensor, block_m: int, block_n: int, block_k: int, stages: int) -> int:
    """The pipeline stages of a launch: the config's, fewer where its tiles do not fit the stage budget (float32 in
    the GPU checks, 32 rows in the bench, a GPU with less shared memory than the H200); at least 2."""
    budget = STAGE_BYTES
    if x.is_cuda:
        budget = min(budget, shared_bytes(x.device.index) - SPARE_BYTES)
    return max(2, min(stages, budget // _stage_bytes(x, block_m, block_n, block_k)))


def _stage_bytes(x: torch.Tensor, block_m: int, block_n: int, block_k: int) -> int:
    """Shared memory of one pipeline stage: a weight tile and an x tile."""
    return (block_n + block_m) * block_k * x.element_size()


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """For an x of 2..MAX_ROWS rows (`kernels.linear` checks the rows): a 16-bit x with unit column stride against
    a contiguous weight of the same dtype and a shape `config` takes, on a GPU of compute capability 8.0 or later
    whose shared memory holds two pipeline stages."""
    if not (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype and x.stride(1) == 1
            and weight.is_contiguous() and weight.shape[1] == x.shape[1]):
        return False
    cfg = config(*weight.shape)
    if cfg is None:
        return False
    if not x.is_cuda:  # Triton's interpreter (the CPU tests)
        return True
    index = x.device.index
    return capable(index) and 2 * _stage_bytes(x, 16, cfg[0], cfg[1]) <= shared_bytes(index)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [m, k] with m <= 32, weight: [n, k] (`applies`; a model's weight: with PDL the kernel may read its
    first chunk while the kernel before it still runs) -> [m, n] = x @ weight.T in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, warps, stages = config(n, k)
    block_m = 16 if m <= 16 else 32
    stages = _stages(x, block_m, block_n, block_k, stages)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    with on_device(x):
        _skinny_kernel[(n // block_n,)](x, weight, out, m, k, x.stride(0), weight.stride(0), out.stride(0),
                                        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                        num_warps=warps, num_stages=stages,
                                        **projection_options(x))
    return out
