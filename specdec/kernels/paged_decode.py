"""Decode attention over the paged KV cache that needs no host-side plan: one query token per sequence, the page
table and the lengths read from device tensors. The draft's captured chain proposal uses it, so a proposal of
`num_steps` tokens costs no attention planning on the host (flashinfer plans each step on the host: ~0.3 ms
each, which the GPU waits for at small batch) and the lengths of step d are computed inside the graph.

Split-KV: program (b, kv head, s) attends the query heads of one KV head over split s (a fixed run of pages) of
sequence b's context with an online softmax and writes a partial output and its log-sum-exp; a second kernel
merges the splits. The number of splits is fixed per page-table width, so the launch shape never changes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels import interpreted, on_device

SPLITS = 32  # most splits a sequence's context is cut into (fewer when the page table is narrower)
BLOCK = 32  # context positions per inner step


@triton.jit
def _split_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, table_stride, lens_ptr, o_ptr, lse_ptr, sm_scale,
                  S: tl.constexpr, CHUNK: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr,
                  D: tl.constexpr, PS: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr,
                  DYNAMIC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    start = s * CHUNK
    end = tl.minimum(n, start + CHUNK)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    rows = b * KV * G + kvh * G + g  # this KV head's query heads
    live = g < G
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=live[:, None], other=0.0)  # [GP, D]
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    # on the GPU only the blocks the sequence reaches; Triton's CPU interpreter wants fixed bounds: all, masked
    for i in range(0, tl.cdiv(end - start, BLOCK) if DYNAMIC else (CHUNK + BLOCK - 1) // BLOCK):
        t = start + i * BLOCK + tl.arange(0, BLOCK)
        ok = t < end
        page = tl.load(table_ptr + b * table_stride + t // PS, mask=ok, other=0).to(tl.int64)
        at = ((page * PS + t % PS) * KV + kvh)[:, None] * D + d[None, :]
        k = tl.load(kc_ptr + at, mask=ok[:, None], other=0.0)  # [BLOCK, D]
        v = tl.load(vc_ptr + at, mask=ok[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale  # [GP, BLOCK]
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN from -inf - -inf
        alpha = tl.exp(m - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    seen = total > 0  # False: the split lies past the sequence's end (weight 0 in the merge)
    safe = tl.where(seen, total, 1.0)
    out = rows * S + s
    tl.store(o_ptr + out[:, None] * D + d[None, :], acc / safe[:, None], mask=live[:, None])
    tl.store(lse_ptr + out, tl.where(seen, m + tl.log(safe), float("-inf")), mask=live)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, out_ptr, S: tl.constexpr, SP: tl.constexpr, D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (sequence, query head)
    s = tl.arange(0, SP)
    d = tl.arange(0, D)
    lse = tl.load(lse_ptr + row * S + s, mask=s < S, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    o = tl.load(o_ptr + (row * S + s)[:, None] * D + d[None, :], mask=(s < S)[:, None], other=0.0)
    tl.store(out_ptr + row * D + d, tl.sum(o * w[:, None], 0).to(out_ptr.dtype.element_ty))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 lens: torch.Tensor, page_size: int, sm_scale: float) -> torch.Tensor:
    """q: [B, H, D] (contiguous); k_cache, v_cache: [num_slots, KV, D] with slot = page * page_size + offset;
    page_table: [B, P] int32, row b's first ceil(lens[b] / page_size) entries are sequence b's pages in order;
    lens: [B] int32, each >= 1 (the query sees positions 0..lens[b]-1). Returns [B, H, D] in q's dtype."""
    b, h, d = q.shape
    kv = k_cache.shape[1]
    width = page_table.shape[1]
    chunk_pages = -(-width // SPLITS)
    splits = -(-width // chunk_pages)
    o_part = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if b:
        with on_device(q):
            _split_kernel[(b, kv, splits)](
                q, k_cache, v_cache, page_table, page_table.stride(0), lens, o_part, lse, sm_scale,
                S=splits, CHUNK=chunk_pages * page_size, KV=kv, G=h // kv, GP=max(16, triton.next_power_of_2(h // kv)),
                D=d, PS=page_size, BLOCK=BLOCK, PREC="ieee" if q.dtype == torch.float32 else "tf32",
                DYNAMIC=not interpreted(), num_warps=4)
            _merge_kernel[(b * h,)](o_part, lse, out, S=splits, SP=triton.next_power_of_2(splits), D=d, num_warps=4)
    return out
