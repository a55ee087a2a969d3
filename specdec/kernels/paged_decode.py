"""Decode attention over the paged KV cache in one kernel that needs no host-side plan: a few query tokens per
sequence at its context's last positions (one for a decode step; a chain's root and drafts for its verify, causal;
a tree verify's root and drafts, each seeing the prefix and what a packed mask row names of the tree), the page
table, the lengths and the masks read from device tensors. The draft's captured chain proposal uses it (a proposal
of `num_steps` tokens costs no attention planning on the host, and the lengths of step d are computed inside the
graph), and so do the target's plain decode and chain and tree verifies at small batch
(`attention/triton_decode.py`); `store_and_attend` is the forward of both attention classes.

Split-KV with the merge in the same launch: program (b, kv head and row block, s) attends its block of a KV
head's (query token, head) rows (all of them up to `ROWS`; a tree's 65 tokens x a GQA group of 4 in blocks of
`ROWS`) over split s of sequence b's context with an online softmax (a split is a whole number of 128-position
units, as few as keep a context within 32 splits: its length depends on the sequence's length alone, so any two
callers that attend the same context round alike, whatever their table width or batch), writes a partial output
and its log-sum-exp, then takes a ticket from a per-(b, kv head, row block) counter; the program that draws the
last ticket merges the splits that reach into the context and puts the counter back to 0 for the next launch. The
grid is fixed per page-table width, so the launch shape never changes (CUDA graphs), and splits past a sequence's
end cost a ticket and two small stores. One launch instead of a split kernel and a merge kernel: at batch 1 a
layer's attention is a few microseconds of work, so each launch's latency counts.
"""

from __future__ import annotations

import numpy as np
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
# (query token, head) rows of one KV head a program holds at most: a tree's 65 queries x a GQA group of 4 are 260,
# cut into blocks of this many (each with its own splits and merge)
ROWS = 64
# trees (`mask`): rows a program, most splits of the prefix (the tree's own positions take one program more) and
# fewest units a split. Many rows fill the GPU already, and fewer splits cost fewer programs and a shorter merge:
# from bench/decode_attn_micro.py --tree on the H200 (batch 1-8, 384 and 2048 positions, twenty-first pass), a
# 65-token tree (9 row blocks a KV head) ran fastest with 2 splits (by 17-29% at 384 positions against 4, even at
# 2048), a 17-token one (3 blocks) with 4 at batch 1-2 (by 17-35% at 2048); rows of 32 against 16 or 64
TREE_ROWS = 32
TREE_SPLITS = 2  # where a KV head's rows take at least TREE_FEW_BLOCKS programs; 4 below
TREE_FEW_BLOCKS = 4
TREE_MIN_UNITS = 2


@triton.jit
def _attend(q, kc_ptr, vc_ptr, table_ptr, table_stride, b, kvh, t, ok, vis, m, total, acc, sm_scale,
            KV: tl.constexpr, D: tl.constexpr, PS: tl.constexpr, PREC: tl.constexpr):
    """One block of context positions `t` (those `ok`; query row r sees position t where vis[r, t]) folded into a
    row block's online softmax (running max m, sum total, output acc). -> (m, total, acc)"""
    d = tl.arange(0, D)
    page = tl.load(table_ptr + b * table_stride + t // PS, mask=ok, other=0).to(tl.int64)
    at = ((page * PS + t % PS) * KV + kvh)[:, None] * D + d[None, :]
    k = tl.load(kc_ptr + at, mask=ok[:, None], other=0.0)  # [BLOCK, D]
    v = tl.load(vc_ptr + at, mask=ok[:, None], other=0.0)
    sc = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale  # [GP, BLOCK]
    sc = tl.where(vis, sc, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN from -inf - -inf
    alpha = tl.exp(m - m_safe)
    p = tl.exp(sc - m_safe[:, None])
    total = total * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, total, acc


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, table_stride, lens_ptr, mask_ptr, o_ptr, lse_ptr, count_ptr,
                   out_ptr, sm_scale, S: tl.constexpr, MAX_S: tl.constexpr, UNIT: tl.constexpr,
                   MAX_CHUNK: tl.constexpr, MIN_UNITS: tl.constexpr, KV: tl.constexpr, G: tl.constexpr,
                   NQ: tl.constexpr, W: tl.constexpr, TB: tl.constexpr, QB: tl.constexpr, GP: tl.constexpr,
                   D: tl.constexpr, PS: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr,
                   MASKED: tl.constexpr, DYNAMIC: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1) // QB
    qb = tl.program_id(1) % QB  # which GP rows of this KV head's NQ * G (query token, head) rows
    s = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    r = qb * GP + tl.arange(0, GP)  # row r: query token r // G, query head r % G of this KV head
    d = tl.arange(0, D)
    rows = (b * NQ + r // G) * KV * G + kvh * G + r % G
    live = r < NQ * G
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=live[:, None], other=0.0)  # [GP, D]
    m = tl.full([GP], float("-inf"), tl.float32)
    total = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    # causal: splits of the whole context, query j sees positions 0 .. n - NQ + j. A tree: splits of the prefix
    # (positions before the queries', seen by all) and one more program, the last, for the queries' own positions,
    # each query seeing those its mask row names (bit i of its W 32-bit words: query i's position)
    reach = n - NQ if MASKED else n
    # the split length depends on this sequence's length only (not on the grid or the table's width), so every
    # caller that attends the same context gets the same splits and the same rounding
    chunk = tl.maximum(tl.cdiv(tl.cdiv(reach, UNIT), MAX_S), MIN_UNITS) * UNIT
    if MASKED and s == S - 1:
        i = tl.arange(0, TB)
        t = reach + i
        ok = i < NQ
        bits = tl.zeros([GP, TB], tl.int32)
        for w in tl.static_range(W):
            word = tl.load(mask_ptr + (b * NQ + r // G) * W + w, mask=live, other=0)  # [GP] int32
            bits = tl.where((i // 32 == w)[None, :], (word[:, None] >> (i % 32)[None, :]) & 1, bits)
        m, total, acc = _attend(q, kc_ptr, vc_ptr, table_ptr, table_stride, b, kvh, t, ok,
                                ok[None, :] & (bits != 0), m, total, acc, sm_scale, KV, D, PS, PREC)
    else:
        start = s * chunk
        end = tl.minimum(reach, start + chunk)
        sees = n - NQ + 1 + r // G
        # on the GPU only the blocks the sequence reaches; Triton's CPU interpreter wants fixed bounds: all, masked
        for blk in range(0, tl.cdiv(end - start, BLOCK) if DYNAMIC else (MAX_CHUNK + BLOCK - 1) // BLOCK):
            t = start + blk * BLOCK + tl.arange(0, BLOCK)
            ok = t < end
            vis = ok[None, :] if MASKED else ok[None, :] & (t[None, :] < sees[:, None])
            m, total, acc = _attend(q, kc_ptr, vc_ptr, table_ptr, table_stride, b, kvh, t, ok, vis, m, total, acc,
                                    sm_scale, KV, D, PS, PREC)
    seen = total > 0  # False: the split lies past what the query sees (weight 0 in the merge)
    safe = tl.where(seen, total, 1.0)
    part = rows * S + s
    tl.store(o_ptr + part[:, None] * D + d[None, :], acc / safe[:, None], mask=live[:, None])
    tl.store(lse_ptr + part, tl.where(seen, m + tl.log(safe), float("-inf")), mask=live)
    # every thread's stores before the ticket (a CTA barrier, then one thread's acq_rel atomic at GPU scope: the
    # partials of all programs with earlier tickets are visible to the one that draws the last)
    tl.debug_barrier()
    counter = count_ptr + (b * KV + kvh) * QB + qb
    ticket = tl.atomic_add(counter, 1)
    if ticket == S - 1:
        tl.debug_barrier()
        tl.store(counter, 0)
        mx = tl.full([GP], float("-inf"), tl.float32)
        wsum = tl.zeros([GP], tl.float32)
        merged = tl.zeros([GP, D], tl.float32)
        # splits past the end have weight 0 (a tree: all, the last is its own positions')
        for j in range(0, tl.cdiv(n, chunk) if DYNAMIC and not MASKED else S):
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


def tiling(rows: int, most: int | None = None) -> tuple[int, int]:
    """(rows a program holds, programs a KV head's rows take) for `rows` (query token, head) rows of one KV head:
    one program where a power of two from 16 up to `most` (default ROWS) holds them, else blocks of `most`."""
    most = most or ROWS
    held = max(16, triton.next_power_of_2(rows))
    return (held, 1) if held <= most else (most, -(-rows // most))


def decode_counters(batch_size: int, kv_heads: int, device, rows: int = 1) -> torch.Tensor:
    """The ticket counters one caller of `paged_decode` keeps for `rows` (query token, head) rows a KV head (its
    queries a sequence x the GQA group; all 0: the kernel leaves them 0), enough for causal queries and for
    trees. # [B * KV * blocks] int32"""
    blocks = max(tiling(rows)[1], tiling(rows, TREE_ROWS)[1])
    return torch.zeros(batch_size * kv_heads * blocks, dtype=torch.int32, device=device)


def pack_tree_masks(masks) -> torch.Tensor:
    """Sequences' [NQ, NQ] visibility masks (query j sees query i; bool tensors on the host) as `paged_decode`'s
    `mask` reads them: bit i of row j's 32-bit words (word i // 32, bit i % 32).
    # [B, NQ, ceil(NQ / 32)] int32, on the host"""
    return torch.from_numpy(np.stack([_packed(m) for m in masks]))


_PACKED: dict[int, tuple[torch.Tensor | None, np.ndarray]] = {}  # id(mask) -> (mask, its words)
_PACKED_MOST = 1024


def _packed(mask: torch.Tensor) -> np.ndarray:
    """One mask's words, kept for the masks seen last (a verify's trees share a few shapes, and
    `tree.ancestor_mask` hands out one tensor per shape, never written): packing a 65-token tree took 8 us on a
    2-core CPU, 140 us a verify under cProfile on the H200's host."""
    hit = _PACKED.get(id(mask))
    if hit is not None and hit[0] is mask:
        return hit[1]
    bits = mask.numpy()
    nq = bits.shape[-1]
    padded = np.zeros((bits.shape[0], 32 * -(-nq // 32)), dtype=bool)
    padded[:, :nq] = bits
    words = np.packbits(padded, axis=-1, bitorder="little").view("<i4").astype(np.int32)  # little-endian words
    if len(_PACKED) >= _PACKED_MOST:
        _PACKED.clear()
    _PACKED[id(mask)] = (mask, words)  # the reference keeps the id from being reused while it is here
    return words


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 lens: torch.Tensor, page_size: int, sm_scale: float, counters: torch.Tensor | None = None,
                 block: int = BLOCK, num_warps: int = 4, queries: int = 1, splits: int | None = None,
                 mask: torch.Tensor | None = None, rows: int | None = None) -> torch.Tensor:
    """q: [B * queries, H, D] (contiguous; sequence b's query tokens are rows b * queries ...); k_cache, v_cache:
    [num_slots, KV, D] with slot = page * page_size + offset; page_table: [B, P] int32, row b's first
    ceil(lens[b] / page_size) entries are sequence b's pages in order; lens: [B] int32, each >= queries (the
    queries are the context's last positions; query j of sequence b sees positions 0..lens[b] - queries + j:
    causal, or with `mask` (from `pack_tree_masks`, on q's device: a tree) the prefix 0..lens[b] - queries - 1
    and the queries its mask row names). `counters`: from `decode_counters` for at least B sequences of these
    rows, used by one stream at a time (None: fresh ones, a memset more). `splits`: the most splits of a context
    (default SPLITS, CHAIN_SPLITS for several queries; `block`, `num_warps`, `splits`, `rows` (a program's most
    rows, default ROWS; for trees TREE_ROWS, and TREE_SPLITS or twice that for few row blocks) are there for
    benchmarks). Returns [B * queries, H, D]
    in q's dtype."""
    t, h, d = q.shape
    b = t // queries
    assert b * queries == t, f"{t} query rows are not {queries} per sequence"
    kv = k_cache.shape[1]
    group = h // kv
    if mask is not None:
        rows = rows or TREE_ROWS
    held, blocks = tiling(queries * group, rows)
    if mask is not None:
        splits = splits or (TREE_SPLITS if blocks >= TREE_FEW_BLOCKS else 2 * TREE_SPLITS)
    splits = splits or (SPLITS if queries == 1 else CHAIN_SPLITS)
    max_ctx = page_table.shape[1] * page_size
    units = -(-max_ctx // UNIT)
    num_splits = min(splits, units) + (mask is not None)  # enough for the longest context the table holds (a tree:
    # and one for its own positions)
    min_units = TREE_MIN_UNITS if mask is not None else 1
    max_chunk = max(-(-units // splits), min_units) * UNIT
    o_part = torch.empty(t, h, num_splits, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(t, h, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if counters is None:
        counters = torch.zeros(b * kv * blocks, dtype=torch.int32, device=q.device)
    assert counters.numel() >= b * kv * blocks and counters.dtype == torch.int32
    words = -(-queries // 32)
    if mask is not None:
        assert mask.shape == (b, queries, words) and mask.dtype == torch.int32, "pack_tree_masks' form"
    if b:
        with on_device(q):
            _decode_kernel[(b, kv * blocks, num_splits)](
                q, k_cache, v_cache, page_table, page_table.stride(0), lens, mask if mask is not None else lens,
                o_part, lse, counters, out, sm_scale, S=num_splits, MAX_S=splits, UNIT=UNIT, MAX_CHUNK=max_chunk,
                MIN_UNITS=min_units,
                KV=kv, G=group, NQ=queries, W=words, TB=max(16, triton.next_power_of_2(queries)), QB=blocks,
                GP=held, D=d, PS=page_size, BLOCK=block, PREC="ieee" if q.dtype == torch.float32 else "tf32",
                MASKED=mask is not None, DYNAMIC=not interpreted(), num_warps=num_warps, **pdl_options(q))
    return out


def store_and_attend(kv_cache, layer: int, q, k, v, table: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor,
                     counters: torch.Tensor, rot=None, scale: float | None = None, queries: int = 1,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's attention of the plan-free classes (`ChainStepAttention`, `TritonDecodeAttention`): this
    forward's K/V written to `slots` of the layer's cache (with `rot`, a `Rotation`: rotary on q and k in the same
    kernel), then `paged_decode` over `table` / `lens` (and a tree's `mask`). Returns [T, H, D] in q's dtype."""
    from specdec.kernels.rope import rope_store

    k_cache, v_cache = kv_cache.k[layer], kv_cache.v[layer]
    if rot is not None:
        q = rope_store(q, k, v, rot.positions, rot.cos_table, rot.sin_table, k_cache, v_cache, slots)
        return paged_decode(q, k_cache, v_cache, table, lens, kv_cache.page_size, q.shape[-1] ** -0.5, counters,
                            queries=queries, mask=mask)
    k_cache[slots] = k.to(k_cache.dtype)
    v_cache[slots] = v.to(v_cache.dtype)
    return paged_decode(q.to(k_cache.dtype).contiguous(), k_cache, v_cache, table, lens, kv_cache.page_size, scale,
                        counters, queries=queries, mask=mask).to(q.dtype)
