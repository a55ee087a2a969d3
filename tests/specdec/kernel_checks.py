"""Fused kernels vs the torch code paths they replace; run by test_kernels.py under TRITON_INTERPRET=1 on CPU and
by tests/gpu on CUDA. Prints one line per check and exits non-zero on the first mismatch."""

from __future__ import annotations

import sys

import torch

from specdec.kernels.activation import silu_mul
from specdec.kernels.gemv import gemv
from specdec.kernels.norm import rmsnorm
from specdec.kernels.paged_decode import decode_counters, paged_decode
from specdec.kernels.rope import rope_store
from specdec.kernels.skinny import skinny_linear
from specdec.models.layers import RotaryEmbedding


def torch_rmsnorm(x, w, eps):
    return w * torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def check(name, got, want, atol, rtol=0.0):
    """Fails unless |got - want| <= atol + rtol * |want| everywhere."""
    diff = (got.float() - want.float()).abs()
    over = (diff - atol - rtol * want.float().abs()).max().item() if got.numel() else -1.0
    print(f"{name}: max abs err {diff.max().item() if got.numel() else 0.0:.3g} (atol {atol}, rtol {rtol})")
    if not over <= 0:
        sys.exit(1)


def main(device: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # float32: rounding-order differences only; bfloat16: one rounding step (2^-8 relative) either way
    tol, rtol = (1e-5, 0.0) if dtype == torch.float32 else (1e-2, 2**-7)
    if device == "cuda" and dtype == torch.float32:
        tol, rtol = 1e-5, 1e-5  # the GPU compiler may contract a product and a sum into one FMA
    exact = device == "cpu" and dtype == torch.float32

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    for rows, n in ((1, 64), (5, 96), (3, 4096), (0, 64)):
        x, r, w = rnd(rows, n), rnd(rows, n), rnd(n)
        check(f"rmsnorm {rows}x{n}", rmsnorm(x, w, 1e-5), torch_rmsnorm(x, w, 1e-5), tol, rtol)
        normed, summed = rmsnorm(x, w, 1e-6, r)
        check(f"add_rmsnorm sum {rows}x{n}", summed, x + r, 0.0)
        check(f"add_rmsnorm norm {rows}x{n}", normed, torch_rmsnorm(x + r, w, 1e-6), tol, rtol)
    wide = rnd(4, 200)  # a strided row view (EAGLE-3 norms read slices)
    check("rmsnorm strided rows", rmsnorm(wide[:, :64], w[:64], 1e-5), torch_rmsnorm(wide[:, :64], w[:64], 1e-5),
          tol, rtol)

    for rows, inter in ((1, 48), (7, 1100), (0, 16)):
        gu = rnd(rows, 2 * inter)
        gate, up = gu.chunk(2, dim=-1)
        check(f"silu_mul {rows}x{inter}", silu_mul(gu), torch.nn.functional.silu(gate) * up, tol, rtol)

    heads, kv_heads, d, t = 4, 2, 16, 6
    rope = RotaryEmbedding(d, 64, 10000.0, None).to(device)
    qkv = rnd(t, (heads + 2 * kv_heads) * d)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k, v = q.reshape(t, heads, d), k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d)
    positions = torch.tensor([0, 1, 2, 9, 33, 63], device=device)
    slots = torch.tensor([5, 0, 7, 3, 12, 9], device=device)
    k_cache = torch.zeros(16, kv_heads, d, device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    got_q = rope_store(q, k, v, positions, rope.cos, rope.sin, k_cache, v_cache, slots)
    want_q, want_k = rope.at(positions, dtype)(q, k)
    # float32 (interpreter): bit-identical; on a GPU: within one rounding step (measured: 1 ulp on a few elements)
    check("rope q", got_q, want_q, *((0.0,) if exact else (tol, rtol)))
    check("rope k in cache", k_cache[slots], want_k, *((0.0,) if exact else (tol, rtol)))
    check("v in cache", v_cache[slots], v, 0.0)
    untouched = torch.ones(16, dtype=torch.bool, device=device)
    untouched[slots] = False
    check("other slots untouched", k_cache[untouched], torch.zeros_like(k_cache[untouched]), 0.0)
    check_paged_decode(device, dtype, g)
    check_chain_step(device, dtype, g)
    check_decode_graph(device, dtype, g)
    check_tree_decode(device, dtype, g)
    check_gemv(device, dtype, g)
    check_skinny(device, dtype, g)
    print("all kernel checks passed")


def check_gemv(device, dtype, g):
    """One row times a weight: chunks of 128, 256 and 512 columns, row counts that are not a multiple of the
    kernel's rows a program (masked), the wide-matrix configuration (n > 8192); against the float64 product,
    within the dtype's rounding of the result (float32: the sum's order only)."""
    for n, k in ((48, 256), (50, 1024), (8200, 256), (40, 384)):
        x = torch.randn(1, k, generator=g).to(device, dtype)
        w = torch.randn(n, k, generator=g).to(device, dtype)
        want = (x.double() @ w.double().T).float()
        scale = want.abs().max().item()
        atol, rtol = (1e-5 * scale, 1e-5) if dtype == torch.float32 else (1e-2, 2**-7)
        check(f"gemv {n}x{k}", gemv(x, w), want, atol, rtol)


def check_skinny(device, dtype, g):
    """A few rows times a weight (`skinny.py`): each of its configurations (64 weight rows a program in 128- and
    64-column chunks, 128 rows for n > 8192, 256-column chunks for k > 8192), 2 to 16 rows, an x whose rows are a
    strided view; against the float64 product, within the dtype's rounding of the result; a row's result is the
    same whatever the other rows (bit for bit)."""
    for n, k in ((64, 128), (192, 64), (8320, 128), (64, 8448)):
        w = torch.randn(n, k, generator=g).to(device, dtype)
        for rows in (2, 7, 16):
            x = torch.randn(rows, k, generator=g).to(device, dtype)
            want = (x.double() @ w.double().T).float()
            scale = want.abs().max().item()
            atol, rtol = (1e-5 * scale, 1e-5) if dtype == torch.float32 else (1e-2 * scale, 2**-7)
            got = skinny_linear(x, w)
            check(f"skinny {rows}x{k} @ {n}x{k}", got, want, atol, rtol)
        check(f"skinny {n}x{k}: rows independent", skinny_linear(x[:3], w), got[:3], 0.0)
    wide = torch.randn(5, 2 * 128, generator=g).to(device, dtype)[:, :128]  # rows 256 apart
    w = torch.randn(64, 128, generator=g).to(device, dtype)
    want = (wide.double() @ w.double().T).float()
    check("skinny strided rows", skinny_linear(wide, w), want, 1e-5 * want.abs().max().item() if
          dtype == torch.float32 else 1e-2 * want.abs().max().item(), 1e-5 if dtype == torch.float32 else 2**-7)


def torch_decode(q, k_cache, v_cache, pages, n, page_size, scale, visible=None):
    """One sequence: q [H, D] over positions 0..n-1 of `pages` (those `visible` [n] bool marks). # [H, D] float32"""
    pos = torch.arange(n) if visible is None else torch.arange(n)[visible]
    slots = torch.tensor(pages)[pos // page_size] * page_size + pos % page_size
    k, v = k_cache[slots.to(q.device)].float(), v_cache[slots.to(q.device)].float()  # [n, KV, D]
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, H, D]
    att = torch.softmax(torch.einsum("hd,nhd->hn", q.float(), k) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", att, v)


def random_tree_mask(nq: int, g) -> torch.Tensor:
    """The ancestor-or-self mask of a random tree of nq nodes (node 0 the root). # [nq, nq] bool"""
    from specdec.tree import ancestor_mask

    return ancestor_mask([int(torch.randint(-1, i, (1,), generator=g)) for i in range(nq - 1)])


def check_tree_decode(device, dtype, g):
    """Tree verifies: each sequence's nq queries are its last nq positions and see the prefix and their tree
    ancestors (and themselves) as the packed mask says; masks of more than 32 queries (two words a row), row
    blocks (a GQA group's rows cut into programs of 16 or 32), contexts that are the tree alone, prefixes of
    several splits (4 for few row blocks, 2 for many); then through
    `TritonDecodeAttention(tree=True)`'s plan (K/V written at the tree's positions, padding with a causal
    mask)."""
    from specdec.attention.batch import SeqAttention
    from specdec.attention.triton_decode import TritonDecodeAttention
    from specdec.kernels.paged_decode import pack_tree_masks
    from specdec.kv_cache import PagedKVCache

    tol = {"cpu": (1e-5, 1e-5), "cuda": (1e-4, 1e-4)}[device] if dtype == torch.float32 else (2e-2, 2e-2)
    for heads, kv_heads, d, page_size, width, nq, rows in ((4, 1, 16, 4, 12, 13, None), (8, 2, 16, 16, 4, 6, 16),
                                                           (4, 1, 16, 8, 8, 40, None), (2, 1, 16, 16, 70, 9, None),
                                                           (4, 1, 16, 16, 40, 40, None)):
        num_pages = 3 * width + 3
        k_cache = torch.randn(num_pages * page_size, kv_heads, d, generator=g).to(device, dtype)
        v_cache = torch.randn(num_pages * page_size, kv_heads, d, generator=g).to(device, dtype)
        lens = [nq, nq + 5, width * page_size]
        perm = torch.randperm(num_pages, generator=g).tolist()
        page_lists = [perm[width * i:][: -(-n // page_size)] for i, n in enumerate(lens)]
        table = torch.zeros(len(lens), width, dtype=torch.int32)
        for i, pages in enumerate(page_lists):
            table[i, : len(pages)] = torch.tensor(pages)
        masks = [random_tree_mask(nq, g) for _ in lens]
        q = torch.randn(len(lens) * nq, heads, d, generator=g).to(device, dtype)
        scale = d ** -0.5
        want = torch.stack([torch_decode(q[i * nq + j], k_cache, v_cache, p, n, page_size, scale,
                                         torch.cat([torch.ones(n - nq, dtype=torch.bool), m[j]]))
                            for i, (p, n, m) in enumerate(zip(page_lists, lens, masks, strict=True))
                            for j in range(nq)])
        packed = pack_tree_masks(masks).to(device)
        got = paged_decode(q, k_cache, v_cache, table.to(device), torch.tensor(lens, dtype=torch.int32).to(device),
                           page_size, scale, queries=nq, mask=packed, rows=rows)
        check(f"paged_decode trees of {nq}, {heads}/{kv_heads} heads, rows {rows}, lens {lens}", got, want, *tol)

    heads, kv_heads, d, page_size, nq = 8, 2, 16, 4, 9
    kv = PagedKVCache(1, kv_heads, d, 48, page_size, dtype, device)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g).to(dtype))
    pages, lens = [[7, 2, 40, 21], [30, 11, 4, 25, 19, 3]], [12, 23]
    seqs = [SeqAttention(torch.tensor([p[i // page_size] * page_size + i % page_size for i in range(m)]), nq,
                         mask) for p, m, mask in zip(pages, lens, (random_tree_mask(nq, g), None), strict=True)]
    attn = TritonDecodeAttention(kv, 2, 8, nq, heads, tree=True)
    attn.plan(seqs, torch.cat([s.ctx_slots[-nq:] for s in seqs]))
    q = torch.randn(2 * nq, heads, d, generator=g).to(device, dtype)
    k = torch.randn(2 * nq, kv_heads, d, generator=g).to(device, dtype)
    v = torch.randn(2 * nq, kv_heads, d, generator=g).to(device, dtype)
    got = attn.forward(0, q, k, v, None, d ** -0.5)
    causal = torch.ones(nq, nq, dtype=torch.bool).tril()
    for i, (p, m, s) in enumerate(zip(pages, lens, seqs, strict=True)):
        mask = causal if s.tail_mask is None else s.tail_mask
        for j in range(nq):
            row, slot = nq * i + j, s.ctx_slots[m - nq + j]
            check(f"tree attention request {i} token {j} K/V", torch.cat([kv.k[0, slot], kv.v[0, slot]]),
                  torch.cat([k[row], v[row]]), 0.0)
            want = torch_decode(q[row], kv.k[0], kv.v[0], p, m, page_size, d ** -0.5,
                                torch.cat([torch.ones(m - nq, dtype=torch.bool), mask[j]]))
            check(f"tree attention request {i} token {j}", got[row], want, *tol)


def check_paged_decode(device, dtype, g):
    """Pages out of order, lengths from 1 to past several splits, GQA groups of 1 and 4."""
    tol = {"cpu": (1e-5, 1e-5), "cuda": (1e-4, 1e-4)}[device] if dtype == torch.float32 else (2e-2, 2e-2)
    # the last: contexts past 32 units of 128 positions, so splits of two units
    for heads, kv_heads, d, page_size, width in ((4, 1, 16, 4, 12), (8, 8, 32, 16, 70), (2, 1, 16, 16, 300)):
        num_pages = 2 * width + 3
        k_cache = torch.randn(num_pages * page_size, kv_heads, d, generator=g).to(device, dtype)
        v_cache = torch.randn(num_pages * page_size, kv_heads, d, generator=g).to(device, dtype)
        lens = [1, page_size + 1, width * page_size // 2 + 3, width * page_size]
        perm = torch.randperm(num_pages, generator=g).tolist()
        page_lists = [perm[3 * i:][: -(-n // page_size)] for i, n in enumerate(lens)]
        table = torch.zeros(len(lens), width, dtype=torch.int32)
        for i, pages in enumerate(page_lists):
            table[i, : len(pages)] = torch.tensor(pages)
        q = torch.randn(len(lens), heads, d, generator=g).to(device, dtype)
        scale = d ** -0.5
        want = torch.stack([torch_decode(q[i], k_cache, v_cache, p, n, page_size, scale)
                            for i, (p, n) in enumerate(zip(page_lists, lens, strict=True))])
        counters = decode_counters(len(lens), kv_heads, device)
        for call in (1, 2):  # the second call reuses the counters the first left at 0
            got = paged_decode(q, k_cache, v_cache, table.to(device),
                               torch.tensor(lens, dtype=torch.int32).to(device), page_size, scale, counters)
            check(f"paged_decode {heads}/{kv_heads} heads, page {page_size}, lens {lens}, call {call}", got, want,
                  *tol)
            check("paged_decode counters back to 0", counters, torch.zeros_like(counters), 0.0)
        wider = torch.cat([table, torch.zeros(len(lens), 40, dtype=torch.int32)], 1).to(device)  # more splits
        check("paged_decode, a wider table: the same rounding", paged_decode(
            q, k_cache, v_cache, wider, torch.tensor(lens, dtype=torch.int32).to(device), page_size, scale), got, 0.0)
        # several causal queries per sequence (a chain verify): query j sees positions 0..len - nq + j
        for nq in (3, 9):
            lq = [max(n, nq) for n in lens]
            pq = [perm[3 * i:][: -(-n // page_size)] for i, n in enumerate(lq)]
            tq = torch.zeros(len(lq), width, dtype=torch.int32)
            for i, pages in enumerate(pq):
                tq[i, : len(pages)] = torch.tensor(pages)
            qq = torch.randn(len(lq) * nq, heads, d, generator=g).to(device, dtype)
            want = torch.stack([torch_decode(qq[i * nq + j], k_cache, v_cache, p, n - nq + 1 + j, page_size, scale)
                                for i, (p, n) in enumerate(zip(pq, lq, strict=True)) for j in range(nq)])
            got = paged_decode(qq, k_cache, v_cache, tq.to(device), torch.tensor(lq, dtype=torch.int32).to(device),
                               page_size, scale, counters, queries=nq)
            check(f"paged_decode {nq} causal queries, {heads}/{kv_heads} heads, lens {lq}", got, want, *tol)
            check("paged_decode counters back to 0", counters, torch.zeros_like(counters), 0.0)


def check_chain_step(device, dtype, g):
    """Step d of the captured chain proposal (`ChainStepAttention`): lengths and write slots derived on the
    device from the page table and the committed lengths; K/V land at position base + d - 1; the attention equals
    the reference over positions 0..base + d - 1."""
    from specdec.attention.chain_step import ChainStepAttention
    from specdec.kv_cache import PagedKVCache

    heads, kv_heads, d, page_size = 4, 2, 16, 4
    kv = PagedKVCache(1, kv_heads, d, 40, page_size, dtype, device)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g).to(dtype))
    base = [3, 8, 21]  # committed lengths (step 1 of the second and step 2 of the first start a new page)
    pages = [[7, 2], [30, 11, 4], [5, 9, 13, 17, 1, 38]]
    table = torch.zeros(3, 8, dtype=torch.int32)
    for i, p in enumerate(pages):
        table[i, : len(p)] = torch.tensor(p)
    table, base_t = table.to(device), torch.tensor(base).to(device)
    q = torch.randn(3, heads, d, generator=g).to(device, dtype)
    k = torch.randn(3, kv_heads, d, generator=g).to(device, dtype)
    v = torch.randn(3, kv_heads, d, generator=g).to(device, dtype)
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    for step in (1, 2):
        got = ChainStepAttention(kv, table, base_t, step).forward(0, q, k, v, None, d ** -0.5)
        for i, (p, n) in enumerate(zip(pages, base, strict=True)):
            pos = n + step - 1
            slot = p[pos // page_size] * page_size + pos % page_size
            check(f"chain step {step} request {i} K/V at position {pos}", torch.cat([kv.k[0, slot], kv.v[0, slot]]),
                  torch.cat([k[i], v[i]]), 0.0)
            want = torch_decode(q[i], kv.k[0], kv.v[0], p, pos + 1, page_size, d ** -0.5)
            check(f"chain step {step} request {i} attention", got[i], want, *tol)


def check_decode_graph(device, dtype, g):
    """The target's captured plain decode at small batch (`TritonDecodeAttention`): planned from page lists (and
    from slot tensors), K/V land at each query's position, the attention equals the reference; planned again for
    longer contexts (a page more), the same buffers give the new result."""
    from specdec.attention.batch import SeqAttention
    from specdec.attention.triton_decode import TritonDecodeAttention
    from specdec.kv_cache import PagedKVCache

    heads, kv_heads, d, page_size = 8, 2, 16, 4
    kv = PagedKVCache(2, kv_heads, d, 48, page_size, dtype, device)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g).to(dtype))
    pages = [[7, 2, 40, 21], [30, 11, 4, 25, 19, 3, 44, 8, 33, 12, 6]]
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    # plain decode (one token a request), then a chain verify of 4 (root + 3 drafts: K/V at the last 4 positions)
    for n, cases in ((1, (([9, 37], False), ([12, 44], True), ([13, 41], False))),
                     (4, (([9, 37], False), ([14, 44], True)))):
        attn = TritonDecodeAttention(kv, 2, 12, n, heads)
        for lens, from_slots in cases:
            if from_slots:
                seqs = [SeqAttention(torch.tensor([p[i // page_size] * page_size + i % page_size for i in range(m)]),
                                     n) for p, m in zip(pages, lens, strict=True)]
                attn.plan(seqs, torch.cat([s.ctx_slots[-n:] for s in seqs]))
            else:
                attn.plan_causal(pages, lens)
            q = torch.randn(2 * n, heads, d, generator=g).to(device, dtype)
            k = torch.randn(2 * n, kv_heads, d, generator=g).to(device, dtype)
            v = torch.randn(2 * n, kv_heads, d, generator=g).to(device, dtype)
            layer = n % 2  # either cache layer
            got = attn.forward(layer, q, k, v, None, d ** -0.5)
            for i, (p, m) in enumerate(zip(pages, lens, strict=True)):
                for j in range(n):
                    pos, row = m - n + j, n * i + j
                    slot = p[pos // page_size] * page_size + pos % page_size
                    what = f"decode graph of {n} a request, lens {lens}, request {i} token {j}"
                    check(f"{what} K/V", torch.cat([kv.k[layer, slot], kv.v[layer, slot]]),
                          torch.cat([k[row], v[row]]), 0.0)
                    want = torch_decode(q[row], kv.k[layer], kv.v[layer], p, pos + 1, page_size, d ** -0.5)
                    check(f"{what} attention", got[row], want, *tol)

if __name__ == "__main__":
    main(sys.argv[1], getattr(torch, sys.argv[2]))
