"""Which forwards the Triton decode attention serves, and its plan's checks (its numbers: kernel_checks.py)."""

from __future__ import annotations

import pytest
import torch

from specdec.attention import triton_decode
from specdec.attention.batch import SeqAttention
from specdec.kv_cache import PagedKVCache


@pytest.fixture
def kv(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels' device check passes on the CPU
    return PagedKVCache(1, 2, 16, 32, 4, torch.float32, "cpu")


def _seq(n: int, num_q: int = 1, mask=None) -> SeqAttention:
    return SeqAttention(torch.arange(n), num_q, mask)


def test_takes_plain_decode_of_a_few_requests_only(kv):
    assert triton_decode.takes(kv, [_seq(9)] * triton_decode.MAX_BATCH)
    assert not triton_decode.takes(kv, [_seq(9)] * (triton_decode.MAX_BATCH + 1))  # larger batches: flashinfer
    assert not triton_decode.takes(kv, [_seq(9), _seq(9, 2)])  # a chain or a prefill (the draft's backend)
    assert not triton_decode.takes(kv, [_seq(9, 1, torch.ones(1, 1, dtype=torch.bool))])  # a tree mask
    assert triton_decode.serves(kv, 2, triton_decode.MAX_CONTEXT)
    assert not triton_decode.serves(kv, 2, triton_decode.MAX_CONTEXT + 1)  # long contexts: flashinfer


def test_takes_nothing_where_the_kernels_do_not_run(kv, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not triton_decode.takes(kv, [_seq(9)])  # a CPU tensor without the interpreter: the torch paths


def test_head_sizes_the_kernels_do_not_tile_go_elsewhere(monkeypatch):
    from specdec.kernels import attention_fused

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention_fused(64) and attention_fused(128) and not attention_fused(96) and not attention_fused(8)
    kv96 = PagedKVCache(1, 2, 96, 32, 4, torch.float32, "cpu")  # e.g. a head of 96: flashinfer / torch paths
    assert not triton_decode.serves(kv96, 1, 10)


def test_plan_refuses_a_context_its_table_cannot_hold(kv):
    attn = triton_decode.TritonDecodeAttention(kv, 1, 3)  # 3 pages of 4
    attn.plan_causal([[5, 6, 7]], [12])
    with pytest.raises(ValueError, match="needs 4 pages"):
        attn.plan_causal([[5, 6, 7, 8]], [13])
    with pytest.raises(ValueError, match="2 given"):
        attn.plan_causal([[5, 6]], [9])


def test_takes_chain_verifies_where_its_caller_asks(kv):
    """The target's backend (`triton_queries` = MAX_QUERIES) sends chain verifies of a few requests here too: the
    same number of causal tokens each, up to MAX_QUERIES; trees and mixed lengths go to flashinfer."""
    most = triton_decode.MAX_QUERIES
    assert triton_decode.takes(kv, [_seq(20, 6)] * 2, most) and triton_decode.takes(kv, [_seq(20, most)], most)
    assert not triton_decode.takes(kv, [_seq(20, most + 1)], most)  # a longer chain
    assert not triton_decode.takes(kv, [_seq(20, 6), _seq(20, 4)], most)  # mixed lengths
    assert not triton_decode.takes(kv, [_seq(20, 3, torch.ones(3, 3, dtype=torch.bool).tril())], most)  # a tree
    assert triton_decode.serves(kv, 4, 100, most) and not triton_decode.serves(kv, 4, 100, most + 1)
    assert not triton_decode.serves(kv, 1, triton_decode.MAX_CHAIN_CONTEXT + 1, 2)  # long: flashinfer's is faster


def test_a_chain_plan_writes_each_tokens_slot(kv):
    attn = triton_decode.TritonDecodeAttention(kv, 2, 4, 3)  # 2 requests of 3 tokens, pages of 4
    attn.plan_causal([[5, 6], [9, 2, 7]], [6, 9])  # positions 3-5 and 6-8
    assert attn.write_slots.tolist() == [23, 24, 25, 10, 11, 28]
    assert attn.lens.tolist() == [6, 9] and attn.table.tolist() == [[5, 6, 0, 0], [9, 2, 7, 0]]


def test_takes_small_tree_verifies_where_its_caller_asks(kv):
    """The target's backend (`triton_trees`) sends tree verifies of a few requests here: the same number of tokens
    each, every mask over just those tokens; more requests, longer contexts or a mask reaching past the request's
    own tokens (a draft's tree step) go to flashinfer."""
    tree = torch.ones(5, 5, dtype=torch.bool).tril()
    most = triton_decode.MAX_TREE_BATCH
    assert triton_decode.takes(kv, [_seq(20, 5, tree)] * most, trees=True)
    assert triton_decode.takes(kv, [_seq(20, 5, tree), _seq(30, 5)], trees=True)  # a chain among trees
    assert not triton_decode.takes(kv, [_seq(20, 5, tree)] * most)  # the draft's backend
    assert not triton_decode.takes(kv, [_seq(20, 5, tree)] * (most + 1), trees=True)
    assert not triton_decode.takes(kv, [_seq(20, 5, tree), _seq(20, 4, tree[:4, :4])], trees=True)
    assert not triton_decode.takes(kv, [_seq(20, 2, torch.ones(2, 5, dtype=torch.bool))], trees=True)
    assert triton_decode.serves(kv, 1, triton_decode.MAX_TREE_CONTEXT, 65, tree=True)
    assert not triton_decode.serves(kv, 1, triton_decode.MAX_TREE_CONTEXT + 1, 65, tree=True)
    assert not triton_decode.serves(kv, 1, 200, triton_decode.MAX_TREE_QUERIES + 1, tree=True)


def test_a_tree_plan_packs_each_requests_mask(kv):
    """Row j of a request's mask as 32-bit words, bit i for query i; a causal request among trees gets the causal
    mask."""
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    attn = triton_decode.TritonDecodeAttention(kv, 2, 4, 3, tree=True)
    seqs = [SeqAttention(torch.arange(5), 3, mask), SeqAttention(torch.arange(16, 22), 3)]
    attn.plan(seqs, torch.cat([s.ctx_slots[-3:] for s in seqs]))
    assert attn.mask.tolist() == [[[1], [3], [5]], [[1], [3], [7]]]
    assert attn.lens.tolist() == [5, 6] and attn.table.tolist() == [[0, 1, 0, 0], [4, 5, 0, 0]]
    assert attn.write_slots.tolist() == [2, 3, 4, 19, 20, 21]
