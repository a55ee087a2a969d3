"""The page tables handed to flashinfer's planner, checked on the CPU against each request's own page list (the
planner itself is GPU-only; `tests/gpu` checks the attention it plans against the torch backend)."""

from __future__ import annotations

import pytest
import torch

from specdec.attention.batch import SeqAttention
from specdec.attention.flashinfer_backend import plan_paged
from specdec.attention.graph_backend import GraphAttention
from specdec.kv_cache import PagedKVCache

PAGE = 4


class Recorder:
    """Stands in for a flashinfer wrapper: keeps what `plan` was given."""

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, *args, **kwargs):
        self.qo_indptr, self.kv_indptr = qo_indptr.tolist(), kv_indptr.tolist()
        self.kv_indices, self.last = kv_indices.tolist(), last_page_len.tolist()
        self.causal = kwargs["causal"]


def _cache_with_interleaved_pages(lengths: list[int]) -> PagedKVCache:
    """Requests grown a page at a time in turn, so each one's pages are scattered through the pool."""
    kv = PagedKVCache(1, 1, 2, 64, PAGE, torch.float32, "cpu")
    for i in range(len(lengths)):
        kv.add(f"r{i}", 3 * PAGE + 4)
    for upto in range(PAGE, max(lengths) + PAGE, PAGE):
        for i, n in enumerate(lengths):
            kv.resize(f"r{i}", min(n, upto))
    return kv


def _expected(kv: PagedKVCache, lengths: list[int], num_q: list[int]) -> tuple[list[int], list[int], list[int]]:
    npages = [-(-n // PAGE) for n in lengths]
    ids = [p for i, k in enumerate(npages) for p in kv.table(f"r{i}").pages[:k]]
    indptr = [0]
    for k in npages:
        indptr.append(indptr[-1] + k)
    last = [n - (k - 1) * PAGE for n, k in zip(lengths, npages, strict=True)]
    return ids, indptr, last


def test_plan_paged_hands_every_requests_pages_in_order():
    lengths = [1, PAGE, PAGE + 1, 3 * PAGE, 2 * PAGE + 3]
    kv = _cache_with_interleaved_pages(lengths)
    num_q = [1, 2, 1, 3, 1]
    seqs = [SeqAttention(kv.slots(f"r{i}", 0, n), q) for i, (n, q) in enumerate(zip(lengths, num_q, strict=True))]
    rec = Recorder()
    plan_paged(rec, kv, 2, seqs, causal=True)
    ids, indptr, last = _expected(kv, lengths, num_q)
    assert rec.kv_indices == ids and len(set(ids)) == len(ids)
    assert rec.kv_indptr == indptr and rec.last == last
    assert rec.qo_indptr == [0, 1, 3, 4, 7, 8] and rec.causal


def test_a_shorter_context_than_the_request_holds_plans_only_its_pages():
    kv = _cache_with_interleaved_pages([3 * PAGE, 3 * PAGE])
    lengths = [PAGE + 2, 2 * PAGE]  # a verify's context can end before the request's last reserved slot
    seqs = [SeqAttention(kv.slots(f"r{i}", 0, n), 1) for i, n in enumerate(lengths)]
    rec = Recorder()
    plan_paged(rec, kv, 2, seqs, causal=True)
    assert (rec.kv_indices, rec.kv_indptr, rec.last) == _expected(kv, lengths, [1, 1])


@pytest.mark.parametrize("n", [1, 3])
def test_graph_plan_from_page_lists_matches_the_plan_from_slots(n):
    """What a captured causal forward plans from page lists (the target's chains and plain steps, the draft's
    proposals) is what the slot path plans: same page tables, queries and K/V write slots."""
    lengths = [PAGE + 1, 2 * PAGE, 5]
    kv = _cache_with_interleaved_pages(lengths)
    attn = GraphAttention.__new__(GraphAttention)  # no flashinfer on the CPU: only the planning state
    attn.kv, attn.num_qo_heads, attn.n, attn.causal = kv, 2, n, True
    attn.wrapper, attn.write_slots = Recorder(), torch.zeros(n * len(lengths), dtype=torch.int64)
    attn.plan_causal([kv.table(f"r{i}").pages for i in range(len(lengths))], lengths)
    from_slots = Recorder()
    plan_paged(from_slots, kv, 2, [SeqAttention(kv.slots(f"r{i}", 0, m), n) for i, m in enumerate(lengths)], True)
    assert attn.wrapper.kv_indices == from_slots.kv_indices == _expected(kv, lengths, [n] * 3)[0]
    assert (attn.wrapper.qo_indptr, attn.wrapper.kv_indptr, attn.wrapper.last) == \
        (from_slots.qo_indptr, from_slots.kv_indptr, from_slots.last)
    assert attn.write_slots.tolist() == [s for i, m in enumerate(lengths) for s in kv.slots(f"r{i}", m - n, m).tolist()]


def test_the_planners_max_reads_tensors_as_the_builtin_does():
    """flashinfer's planner takes `max` of host tensors (largest query and KV lengths); `_tensor_max` stands in for
    it there with the same value, and is the builtin for anything else."""
    from specdec.attention.flashinfer_backend import _tensor_max

    lens = torch.tensor([5, 17, 3, 17, 9], dtype=torch.int32)
    assert _tensor_max(lens).item() == max(lens).item() == 17
    assert _tensor_max(lens[1:] - lens[:-1]).item() == max(lens[1:] - lens[:-1]).item()
    assert _tensor_max(3, 128) == 128 and _tensor_max([4, 9, 2]) == 9 and _tensor_max([], default=0) == 0
    with pytest.raises(ValueError):
        _tensor_max(torch.tensor([], dtype=torch.int32))
