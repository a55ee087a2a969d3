"""Plain decode (one token per request) and chain verifies (a root and its drafts, causal) at small batch through
the one-kernel Triton decode attention (`specdec.kernels.paged_decode`) instead of flashinfer: up to `MAX_BATCH`
requests of at most `MAX_QUERIES` tokens whose contexts are at most `MAX_CONTEXT` positions (`MAX_CHAIN_CONTEXT`
for more than one token a request), in the target's captured causal forwards (a second graph per small batch
size, chosen per step by the context lengths) and in the flashinfer backend's eager forwards of the same batches
(so replay == eager).

At batch 1-4 a layer's decode attention is a few microseconds of work; flashinfer's path spends two kernels on it
(its prefill kernel and the merge of its KV splits, ~11.5 us a layer on an H200) and plans on the host (~0.2 ms
a step). This one plans by writing two small device buffers, with the interface of `GraphAttention`'s causal
plans (`plan`, `plan_causal`), so `TargetGraphs` swaps one for the other per shape. Measured in
docs/benchmarks.md (fifteenth pass): at batch 8 and at ~4000 positions it was slower, so those keep flashinfer;
a chain verify's several queries (sixteenth pass) won at 384 positions and lost at 1 request from 1024 on.
"""

from __future__ import annotations

import torch

from specdec.attention.batch import SeqAttention
from specdec.host_copy import copy_in

MAX_BATCH = 4  # plain-decode batches up to this size attend here (larger: flashinfer)
MAX_CONTEXT = 2048  # positions: longer contexts go to flashinfer (at ~4000 its kernel was 3-10 us a layer faster)
MAX_QUERIES = 9  # tokens per request: plain decode and chain verifies of up to 8 drafts (longer: flashinfer)
# positions, for several tokens a request: at 384 the kernel beat flashinfer's at 1-4 requests and 7 or 9 tokens
# (8.8-13.3 us a layer against 10.2-16.4), at 1024 it lost at 1 request and at 4 of 9 tokens (sixteenth pass)
MAX_CHAIN_CONTEXT = 512


def serves(kv_cache, num_seqs: int, max_len: int, n: int = 1) -> bool:
    """Whether a causal forward of `num_seqs` requests of `n` tokens each whose longest context is `max_len`
    positions attends here: small enough, on a device the Triton kernels run on, and `SPECDEC_DECODE_KERNEL` not
    0."""
    from specdec.kernels import attention_fused, decode_kernel_on, fused

    return (num_seqs <= MAX_BATCH and 1 <= n <= MAX_QUERIES and max_len <= longest_context(n) and fused(kv_cache.k)
            and attention_fused(kv_cache.k.shape[-1]) and decode_kernel_on())


def longest_context(n: int) -> int:
    """The longest context (positions) a forward of n tokens a request attends here at."""
    return MAX_CONTEXT if n == 1 else MAX_CHAIN_CONTEXT


def takes(kv_cache, seqs: list[SeqAttention], max_queries: int = 1) -> bool:
    """Whether an eager forward over `seqs` is served here: the same number (up to `max_queries`) of causal
    queries each (a plain decode, a chain verify; not a tree), few enough and short enough."""
    n = seqs[0].num_q if seqs else 0
    return (n <= max_queries and all(s.num_q == n and s.tail_mask is None for s in seqs)
            and serves(kv_cache, len(seqs), max((s.ctx_slots.shape[0] for s in seqs), default=0), n))


class TritonDecodeAttention:
    name = "triton-decode"
    fuses_rope = True

    def __init__(self, kv_cache, batch_size: int, max_pages_per_seq: int, n: int = 1):
        from specdec.kernels.paged_decode import decode_counters  # imports Triton

        self.kv, self.batch_size, self.n = kv_cache, batch_size, n
        dev = kv_cache.k.device
        width = max_pages_per_seq
        # one buffer, one copy per plan: row b of the table, then the lengths
        self._meta = torch.zeros(batch_size * width + batch_size, dtype=torch.int32, device=dev)
        self.table = self._meta[: batch_size * width].view(batch_size, width)  # [B, P] pages in order
        self.lens = self._meta[batch_size * width :]  # [B] positions each query sees (its own included)
        self.lens.fill_(n)
        self.write_slots = torch.zeros(batch_size * n, dtype=torch.int64, device=dev)  # [B * n] the queries' K/V slots
        self.counters = decode_counters(batch_size, kv_cache.k.shape[2], dev)

    def plan(self, seqs: list[SeqAttention], write_slots: torch.Tensor) -> None:
        """Host side, before capture or replay: `batch_size` sequences of `n` causal queries each."""
        ps = self.kv.page_size
        assert len(seqs) == self.batch_size and all(s.num_q == self.n and s.tail_mask is None for s in seqs)
        self.plan_causal([(s.ctx_slots[::ps] // ps).tolist() for s in seqs], [s.ctx_slots.shape[0] for s in seqs],
                         write_slots)

    def plan_causal(self, page_lists: list[list[int]], lens: list[int], write_slots=None) -> None:
        """Sequence i's queries are positions lens[i] - n .. lens[i] - 1 of the pages `page_lists[i]`, each seeing
        the positions up to its own; their K/V go to those positions' slots (or `write_slots[i * n:][:n]`). Python
        lists throughout."""
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
                                rot=rot, queries=self.n)

    def forward(self, layer: int, q, k, v, batch, scale: float) -> torch.Tensor:
        from specdec.kernels.paged_decode import store_and_attend

        return store_and_attend(self.kv, layer, q, k, v, self.table, self.lens, self.write_slots, self.counters,
                                scale=scale, queries=self.n)
