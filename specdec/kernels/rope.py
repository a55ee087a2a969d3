"""Rotary embedding of q and k plus the K/V write into the paged cache, one kernel for a whole layer.

Program (t, h): token t, head h over [q heads | k heads | v heads]. q heads are rotated into a new contiguous
q; k heads are rotated and v heads copied into the cache at slot `slots[t]`. Rounding as in `Rotation` (HF's
rotate-half): cos/sin rounded to the dtype, each product rounded, then the sum rounded: bit-identical to the torch
path in float32, within one rounding step in bfloat16 on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels import on_device
from specdec.kernels.pdl import pdl_enter, pdl_options


@triton.jit
def _rotate(base, c1, s1, c2, s2, half, HALF: tl.constexpr, dt: tl.constexpr):
    x1 = tl.load(base + half).to(tl.float32)
    x2 = tl.load(base + HALF + half).to(tl.float32)
    a1 = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
    a2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    return a1.to(dt), a2.to(dt)


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, q_stride, k_stride, v_stride, pos_ptr, cos_ptr, sin_ptr, slot_ptr,
                       kc_ptr, vc_ptr, qo_ptr, H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    dt = qo_ptr.dtype.element_ty
    half = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c1 = tl.load(cos_ptr + pos * D + half).to(dt).to(tl.float32)
    c2 = tl.load(cos_ptr + pos * D + HALF + half).to(dt).to(tl.float32)
    s1 = tl.load(sin_ptr + pos * D + half).to(dt).to(tl.float32)
    s2 = tl.load(sin_ptr + pos * D + HALF + half).to(dt).to(tl.float32)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if h < H:
        a1, a2 = _rotate(q_ptr + t * q_stride + h * D, c1, s1, c2, s2, half, HALF, dt)
        out = qo_ptr + (t * H + h) * D
        tl.store(out + half, a1)
        tl.store(out + HALF + half, a2)
    elif h < H + KV:
        kh = h - H
        a1, a2 = _rotate(k_ptr + t * k_stride + kh * D, c1, s1, c2, s2, half, HALF, dt)
        out = kc_ptr + (slot * KV + kh) * D
        tl.store(out + half, a1.to(kc_ptr.dtype.element_ty))
        tl.store(out + HALF + half, a2.to(kc_ptr.dtype.element_ty))
    else:
        vh = h - H - KV
        cols = tl.arange(0, D)
        v = tl.load(v_ptr + t * v_stride + vh * D + cols)
        tl.store(vc_ptr + (slot * KV + vh) * D + cols, v.to(vc_ptr.dtype.element_ty))


def rope_store(q, k, v, positions, cos_table, sin_table, k_cache, v_cache, slots) -> torch.Tensor:
    """q: [T, H, D], k, v: [T, KV, D] (head and element strides contiguous, e.g. views of the qkv projection);
    positions, slots: [T] int64; cos/sin tables: [max_positions, D] float32; k_cache, v_cache: [num_slots, KV, D].
    Writes rotated k and v at `slots`; returns rotated q [T, H, D] (contiguous)."""
    t, h, d = q.shape
    kv = k.shape[1]
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and q.stride(1) == k.stride(1) == v.stride(1) == d
    q_out = torch.empty((t, h, d), dtype=q.dtype, device=q.device)
    if t:
        with on_device(q):
            _rope_store_kernel[(t, h + 2 * kv)](
                q, k, v, q.stride(0), k.stride(0), v.stride(0), positions, cos_table, sin_table, slots,
                k_cache, v_cache, q_out, H=h, KV=kv, D=d, num_warps=1, **pdl_options(q),
            )
    return q_out
