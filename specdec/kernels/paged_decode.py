"""Decode attention over the paged KV cache in one kernel that needs no host-side plan: a few causal query tokens
per sequence (one for a decode step, a chain's root and drafts for its verify), the page table and the lengths
read from device tensors. The draft's captured chain proposal uses it (a proposal of `num_steps` tokens costs no
attention planning on the host, and the lengths of step d are computed inside the graph), and so do the target's
plain decode and chain verifies at small batch (`attention/triton_decode.py`); `store_and_attend` is the forward
of both attention classes.

Split-KV with the merge in the same launch: program (b, kv head, s) attends the query heads of one KV head (of
all the sequence's query tokens: rows token-major, query j sees the context up to its own position) over split s
of sequence b's context with an online softmax (a split is a whole number of 128-position units, as few
as keep a context within 32 splits: its length depends on the sequence's length alone, so any two callers that
attend the same context round alike, whatever their table width or batch), writes a partial output and its
log-sum-exp, then takes a ticket from a per-(b, kv head) counter; the program that draws the last ticket merges
the splits that reach into the context and puts the counter back to 0 for the next launch. The grid is fixed per
page-table width, so the launch shape never changes (CUDA graphs), and splits past a sequence's end cost a ticket
and two small stores. One launch instead of a split kernel and a merge kernel: at batch 1 a layer's
attention is a few microseconds of work, so each launch's latency counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.kernels import interpreted, on_device
from specdec.kernels.pdl import pdl_enter, pdl_options

SPLITS = 32  # most splits a sequence's context is cut into (one query per sequence)
# several queries: the merge (one program per sequence and KV head) reads every split's partials of all of them,
# 9 x 4 rows of 128 floats a split at a chain of 8, GQA 4; at 8 splits (against 32) a chain verify of 1-4 requests
# ran 0.2-22 us a layer faster, and 2-6 faster than flashinfer's at 384 positions (docs/benchmarks.md, sixteenth pass)
CHAIN_SPLITS = 8
UNIT = 128  # positions: a split is a whole number of units, as few as keep the splits within SPLITS
BLOCK = 128  # context positions per inner step (one unit: measured faster than 64 or 32 at batch 1-2)


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, table_stride, lens_ptr, o_ptr, lse_ptr, count_ptr, out_ptr,
                   sm_scale, S: tl.constexpr, MAX_S: tl.constexpr, UNIT: tl.constexpr, MAX_CHUNK: tl.constexpr,
                   KV: tl.constexpr, G: tl.constexpr, NQ: tl.constexpr,
                   GP: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr,
                   DYNAMIC: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    # the split length depends on this sequence's length only (not on the grid or the table's width), so every
    # caller that attends the same context gets the same splits and the same rounding
    chunk = tl.cdiv(tl.cdiv(n, UNIT), MAX_S) * UNIT
    start = s * chunk
    end = tl.minimum(n, start + chunk)
    r = tl.arange(0, GP)  # row r: query token r // G, query head r % G of this KV head
    d = tl.arange(0, D)
    rows = (b * NQ + r // G) * KV * G + kvh * G + r % G
    live = r < NQ * G
    sees = n - NQ + 1 + r // G  # causal: query j sees positions 0 .. n - NQ + j
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=live[:, None], other=0.0)  # [GP, D]
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    # on the GPU only the blocks the sequence reaches; Triton's CPU interpreter wants fixed bounds: all, masked
    for i in range(0, tl.cdiv(end - start, BLOCK) if DYNAMIC else (MAX_CHUNK + BLOCK - 1) // BLOCK):
        t = start + i * BLOCK + tl.arange(0, BLOCK)
        ok = t < end
        page = tl.load(table_ptr + b * table_stride + t // PS, mask=ok, other=0).to(tl.int64)
        at = ((page * PS + t % PS) * KV + kvh)[:, None] * D + d[None, :]
        k = tl.load(kc_ptr + at, mask=ok[:, None], other=0.0)  # [BLOCK, D]
        v = tl.load(vc_ptr + at, mask=ok[:, None], other=0.0)
        sc = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale  # [GP, BLOCK]
        sc = tl.where(ok[None, :] & (t[None, :] < sees[:, None]), sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN from -inf - -inf
        alpha = tl.exp(m - m_safe)
        p = tl.exp(sc - m_safe[:, None])
        total = total * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m = m_new
    seen = total > 0  # False: the split lies past what the query sees (weight 0 in the merge)
    safe = tl.where(seen, total, 1.0)
    part = rows * S + s
    tl.store(o_ptr + part[:, None] * D + d[None, :], acc / safe[:, None], mask=live[:, None])
    tl.store(lse_ptr + part, tl.where(seen, m + tl.log(safe), float("-inf")), mask=live)
    # every thread's stores before the ticket (a CTA barrier, then one thread's acq_rel atomic at GPU scope: the
    # partials of all programs with earlier tickets are visible to the one that draws the last)
    tl.debug_barrier()
    ticket = tl.atomic_add(count_ptr + b * KV + kvh, 1)
    if ticket == S - 1:
        tl.debug_barrier()
        tl.store(count_ptr + b * KV + kvh, 0)
        mx = tl.full([GP], float("-inf"), tl.float32)
        wsum = tl.zeros([GP], tl.float32)
        merged = tl.zeros([GP, D], tl.float32)
        for j in range(0, tl.cdiv(n, chunk) if DYNAMIC else S):  # splits past the end have weight 0
            at = rows * S + j
            lse = tl.load(lse_ptr + at, mask=live, other=float("-inf"), cache_modifier=".cg")
            o = tl.load(o_ptr + at[:, None] * D + d[None, :], mask=live[:, None], other=0.0, cache_modifier=".cg")
            mx_new = tl.maximum(mx, lse)
            mx_safe = tl.where(mx_new == float("-inf"), 0.0, mx_new)
            scale_old = tl.exp(mx - mx_safe)
            w = tl.exp(lse - mx_safe)
            wsum = wsum * scale_old + w
            merged = merged * scale_old[:, None] + o * w[:, None]
            mx = mx_new
        merged = merged / tl.where(wsum > 0, wsum, 1.0)[:, None]
        tl.store(out_ptr + rows[:, None] * D + d[None, :], merged.to(out_ptr.dtype.element_ty), mask=live[:, None])


def decode_counters(batch_size: int, kv_heads: int, device) -> torch.Tensor:
    """The ticket counters one caller of `paged_decode` keeps (all 0; the kernel leaves them 0). # [B * KV] int32"""
    return torch.zeros(batch_size * kv_heads, dtype=torch.int32, device=device)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 lens: torch.Tensor, page_size: int, sm_scale: float, counters: torch.Tensor | None = None,
                 block: int = BLOCK, num_warps: int = 4, queries: int = 1, splits: int | None = None) -> torch.Tensor:
    """q: [B * queries, H, D] (contiguous; sequence b's query tokens are rows b * queries ...); k_cache, v_cache:
    [num_slots, KV, D] with slot = page * page_size + offset; page_table: [B, P] int32, row b's first
    ceil(lens[b] / page_size) entries are sequence b's pages in order; lens: [B] int32, each >= queries (query j
    of sequence b sees positions 0..lens[b] - queries + j: causal, the queries are the context's last positions).
    `counters`: from `decode_counters` for at least B sequences, used by one stream at a time (None: fresh ones, a
    memset more). `splits`: the most splits of a context (default SPLITS, CHAIN_SPLITS for several queries;
    `block`, `num_warps`, `splits` are there for benchmarks). Returns [B * queries, H, D] in q's dtype."""
    t, h, d = q.shape
    b = t // queries
    splits = splits or (SPLITS if queries == 1 else CHAIN_SPLITS)
    assert b * queries == t, f"{t} query rows are not {queries} per sequence"
    kv = k_cache.shape[1]
    max_ctx = page_table.shape[1] * page_size
    units = -(-max_ctx // UNIT)
    num_splits = min(splits, units)  # enough for the longest context the table holds
    max_chunk = -(-units // splits) * UNIT
    o_part = torch.empty(t, h, num_splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(t, h, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if counters is None:
        counters = decode_counters(b, kv, q.device)
    assert counters.numel() >= b * kv and counters.dtype == torch.int32
    if b:
        with on_device(q):
            _decode_kernel[(b, kv, num_splits)](
                q, k_cache, v_cache, page_table, page_table.stride(0), lens, o_part, lse, counters, out, sm_scale,
                S=num_splits, MAX_S=splits, UNIT=UNIT, MAX_CHUNK=max_chunk, KV=kv, G=h // kv, NQ=queries,
                GP=max(16, triton.next_power_of_2(queries * (h // kv))), D=d, PS=page_size, BLOCK=block,
                PREC="ieee" if q.dtype == torch.float32 else "tf32", DYNAMIC=not interpreted(), num_warps=num_warps,
                **pdl_options(q))
    return out


def store_and_attend(kv_cache, layer: int, q, k, v, table: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor,
                     counters: torch.Tensor, rot=None, scale: float | None = None, queries: int = 1) -> torch.Tensor:
    """One layer's attention of the plan-free classes (`ChainStepAttention`, `TritonDecodeAttention`): this
    forward's K/V written to `slots` of the layer's cache (with `rot`, a `Rotation`: rotary on q and k in the same
    kernel), then `paged_decode` over `table` / `lens`. Returns [T, H, D] in q's dtype."""
    from specdec.kernels.rope import rope_store

    k_cache, v_cache = kv_cache.k[layer], kv_cache.v[layer]
    if rot is not None:
        q = rope_store(q, k, v, rot.positions, rot.cos_table, rot.sin_table, k_cache, v_cache, slots)
        return paged_decode(q, k_cache, v_cache, table, lens, kv_cache.page_size, q.shape[-1] ** -0.5, counters,
                            queries=queries)
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)
    return paged_decode(q.to(k_cache.dtype).contiguous(), k_cache, v_cache, table, lens, kv_cache.page_size, scale,
                        counters, queries=queries).to(q.dtype)
