"""Plain decode (one token per request), chain verifies (a root and its drafts, causal) and tree verifies (a
mask per request over its own tokens) at small batch through the one-kernel Triton decode attention
(`specdec.kernels.paged_decode`) instead of flashinfer: up to `MAX_BATCH` requests of at most `MAX_QUERIES`
tokens whose contexts are at most `MAX_CONTEXT` positions (`MAX_CHAIN_CONTEXT` for more than one token a request;
the `MAX_TREE_*` limits for trees), in the target's captured forwards (a second graph per small batch size,
chosen per step by the context lengths) and in the flashinfer backend's eager forwards of the same batches (so
replay == eager).

At batch 1-4 a layer's decode attention is a few microseconds of work; flashinfer's path spends two kernels on it
(its prefill kernel and the merge of its KV splits, ~11.5 us a layer on an H200) and plans on the host (~0.2 ms
a step; a tree's masked plan ~0.4 ms). This one plans by writing two small device buffers (a tree's packed mask
a third), with the interface of `GraphAttention`'s plans (`plan`, `plan_causal`), so `TargetGraphs` swaps one for
the other per shape. Measured in docs/benchmarks.md (fifteenth pass): at batch 8 and at ~4000 positions it was
slower as kernels, and a chain verify's several queries (sixteenth pass) won at 384 positions and lost at 1 request
from 1024 on; but whole calls (forty-first pass), the host plan included, ran faster here up to ~3700 positions at
1-4 requests, so contexts up to 4096 attend here. Batch 8 keeps flashinfer.
"""

from __future__ import annotations

import torch

from specdec.attention.batch import SeqAttention
from specdec.host_copy import copy_in

MAX_BATCH = 4  # plain-decode batches up to this size attend here (larger: flashinfer)
# positions: longer contexts go to flashinfer. At ~4000 its kernel was 3-10 us a layer faster (fifteenth pass), but its
# step plans on the host (0.2-0.6 ms before the launch): whole plain-decode calls at 1-4 requests and 2300-3730
# positions ran 0.09-0.37 ms faster here (bench/chain_context_ab.py --drafts 0, forty-first pass)
MAX_CONTEXT = 4096
MAX_QUERIES = 9  # tokens per request: plain decode and chain verifies of up to 8 drafts (longer: flashinfer)
# positions, for several tokens a request: from 1024 on flashinfer's kernel is up to ~5 us a layer faster at 1 request
# (sixteenth pass), but whole verify calls of chains of 5 and 8 drafts at 1-4 requests ran faster here at 640-3740
# positions (by 0.1-0.96 ms; 0.05-0.48 ms past 2048, one row of 27 0.07 ms slower), the host plan costing more than
# the faster kernel saves (bench/chain_context_ab.py, forty-first pass)
MAX_CHAIN_CONTEXT = MAX_CONTEXT
# tree verifies (a mask per request) at small batch: measured against flashinfer's masked prefill (which also plans
# on the host: ~0.4 ms of a 64-token tree's verify) in bench/decode_attn_micro.py --tree (twenty-first pass)
MAX_TREE_BATCH = 8
MAX_TREE_QUERIES = 128  # tokens per request (a tree's root and drafts)
MAX_TREE_CONTEXT = 2048


def serves(kv_cache, num_seqs: int, max_len: int, n: int = 1, tree: bool = False) -> bool:
    """Whether a forward of `num_seqs` requests of `n` tokens each (causal, or `tree`: each with a mask over its
    own tokens) whose longest context is `max_len` positions attends here: small enough, on a device the Triton
    kernels run on, and `SPECDEC_DECODE_KERNEL` (for trees also `SPECDEC_TREE_KERNEL`) not 0."""
    from specdec.kernels import attention_fused, decode_kernel_on, fused, tree_kernel_on

    if tree:
        small = (num_seqs <= MAX_TREE_BATCH and 1 <= n <= MAX_TREE_QUERIES and max_len <= MAX_TREE_CONTEXT
                 and tree_kernel_on())
    else:
        small = num_seqs <= MAX_BATCH and 1 <= n <= MAX_QUERIES and max_len <= longest_context(n)
    return (small and fused(kv_cache.k) and attention_fused(kv_cache.k.shape[-1]) and decode_kernel_on())


def longest_context(n: int, tree: bool = False) -> int:
    """The longest context (positions) a forward of n tokens a request (causal, or trees) attends here at."""
    if tree:
        return MAX_TREE_CONTEXT
    return MAX_CONTEXT if n == 1 else MAX_CHAIN_CONTEXT


def takes(kv_cache, seqs: list[SeqAttention], max_queries: int = 1, trees: bool = False) -> bool:
    """Whether an eager forward over `seqs` is served here: the same number (up to `max_queries`) of causal
    queries each (a plain decode, a chain verify), or with `trees` the same number of queries each whose masks
    cover just those queries (tree verifies); few enough and short enough."""
    n = seqs[0].num_q if seqs else 0
    if not all(s.num_q == n for s in seqs):
        return False
    longest = max((s.ctx_slots.shape[0] for s in seqs), default=0)
    if all(s.tail_mask is None for s in seqs):
        return n <= max_queries and serves(kv_cache, len(seqs), longest, n)
    return trees and all(s.tail_len == n for s in seqs) and serves(kv_cache, len(seqs), longest, n, tree=True)


class TritonDecodeAttention:
    name = "triton-decode"
    fuses_rope = True

    def __init__(self, kv_cache, batch_size: int, max_pages_per_seq: int, n: int = 1, num_qo_heads: int | None = None,
                 tree: bool = False):
        """`num_qo_heads`: the model's query heads (default: as many as KV heads); `tree`: each sequence's n
        queries see each other through a mask (`plan` takes trees' masks), not causally."""
        from specdec.kernels.paged_decode import decode_counters  # imports Triton

        self.kv, self.batch_size, self.n, self.tree = kv_cache, batch_size, n, tree
        dev = kv_cache.k.device
        width = max_pages_per_seq
        # one buffer, one copy per plan: row b of the table, then the lengths
        self._meta = torch.zeros(batch_size * width + batch_size, dtype=torch.int32, device=dev)
        self.table = self._meta[: batch_size * width].view(batch_size, width)  # [B, P] pages in order
        self.lens = self._meta[batch_size * width :]  # [B] positions each query sees (its own included)
        self.lens.fill_(n)
        self.write_slots = torch.zeros(batch_size * n, dtype=torch.int64, device=dev)  # [B * n] the queries' K/V slots
        kv_heads = kv_cache.k.shape[2]
        self.counters = decode_counters(batch_size, kv_heads, dev, n * (num_qo_heads or kv_heads) // kv_heads)
        # [B, n, ceil(n / 32)] a tree's visibility bits (`paged_decode.pack_tree_masks`); a causal request's
        self.mask = torch.zeros(batch_size, n, -(-n // 32), dtype=torch.int32, device=dev) if tree else None
        self._causal = torch.ones(n, n, dtype=torch.bool).tril() if tree else None

    def plan(self, seqs: list[SeqAttention], write_slots: torch.Tensor) -> None:
        """Host side, before capture or replay: `batch_size` sequences of `n` queries each (causal, or for a tree
        attention each with an [n, n] tail mask, None for a causal one)."""
        ps = self.kv.page_size
        assert len(seqs) == self.batch_size and all(s.num_q == self.n and s.tail_len == self.n for s in seqs)
        assert self.tree or all(s.tail_mask is None for s in seqs)
        if self.tree:
            from specdec.kernels.paged_decode import pack_tree_masks

            copy_in(self.mask, pack_tree_masks([self._causal if s.tail_mask is None else s.tail_mask for s in seqs]))
        self.plan_causal([(s.ctx_slots[::ps] // ps).tolist() for s in seqs], [s.ctx_slots.shape[0] for s in seqs],
                         write_slots)

    def plan_causal(self, page_lists: list[list[int]], lens: list[int], write_slots=None) -> None:
        """Sequence i's queries are positions lens[i] - n .. lens[i] - 1 of the pages `page_lists[i]`, each seeing
        the positions up to its own (a tree attention: as its mask, which `plan` writes); their K/V go to those
        positions' slots (or `write_slots[i * n:][:n]`). Python lists throughout."""
        ps, width, n = self.kv.page_size, self.table.shape[1], self.n
        meta: list[int] = []
        for pages, end in zip(page_lists, lens, strict=True):
            used = -(-end // ps)
            if not used <= min(width, len(pages)):
                raise ValueError(f"a context of {end} positions needs {used} pages; {len(pages)} given, the "
                                 f"graph's table holds {width}")
            meta += pages[:used]
            meta += [0] * (width - used)
        copy_in(self._meta, meta + list(lens))
        if write_slots is None:
            write_slots = [pages[pos // ps] * ps + pos % ps
                           for pages, end in zip(page_lists, lens, strict=True) for pos in range(end - n, end)]
        copy_in(self.write_slots, write_slots)

    def forward_rope(self, layer: int, q, k, v, rot, batch) -> torch.Tensor:
        from specdec.kernels.paged_decode import store_and_attend

        return store_and_attend(self.kv, layer, q, k, v, self.table, self.lens, self.write_slots, self.counters,
                                rot=rot, queries=self.n, mask=self.mask)

    def forward(self, layer: int, q, k, v, batch, scale: float) -> torch.Tensor:
        from specdec.kernels.paged_decode import store_and_attend

        return store_and_attend(self.kv, layer, q, k, v, self.table, self.lens, self.write_slots, self.counters,
                                scale=scale, queries=self.n, mask=self.mask)
