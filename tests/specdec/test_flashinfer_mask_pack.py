"""Custom masks packed on the host the way flashinfer's kernels read them (the kernels are GPU-only; `tests/gpu`
checks tree attention through them against the torch backend)."""

from __future__ import annotations

import torch

from specdec.attention.batch import SeqAttention
from specdec.attention.flashinfer_backend import pack_masks, plan_paged
from specdec.attention.torch_backend import visibility_mask
from specdec.kv_cache import PagedKVCache
from specdec.tree import ancestor_mask


def _bit(packed: torch.Tensor, start_byte: int, offset: int) -> bool:
    """How flashinfer's prefill kernel reads a custom mask bit: `(mask_ptr[offset / 8] >> (offset % 8)) & 1`,
    `mask_ptr` = the packed mask + the sequence's mask_indptr entry (bytes)."""
    return bool((int(packed[start_byte + offset // 8]) >> (offset % 8)) & 1)


def test_packed_masks_read_back_bit_for_bit_at_byte_offsets():
    gen = torch.Generator().manual_seed(0)
    masks = [torch.rand(q, k, generator=gen) > 0.5 for q, k in ((1, 1), (3, 5), (7, 20), (9, 64), (2, 3))]
    packed, indptr = pack_masks(masks)
    assert packed.dtype == torch.uint8 and indptr[0] == 0 and indptr[-1] == packed.numel()
    for m, start, end in zip(masks, indptr, indptr[1:], strict=False):
        q, k = m.shape
        assert end - start == -(-(q * k) // 8)  # each sequence starts on a byte of its own
        assert [[_bit(packed, start, i * k + j) for j in range(k)] for i in range(q)] == m.tolist()


class Recorder:
    """Stands in for a flashinfer wrapper that is not in CUDA-graph mode."""

    is_cuda_graph_enabled = False
    device = torch.device("cpu")

    def plan(self, *args, **kwargs):
        self.packed, self.causal = kwargs["packed_custom_mask"], kwargs["causal"]


def test_a_tree_plan_hands_flashinfer_packed_masks_and_their_byte_offsets():
    kv = PagedKVCache(1, 1, 2, 64, 4, torch.float32, "cpu")
    parents = [[-1, -1, 0, 0, 2, 1], [-1, 0, 0]]
    seqs = []
    for i, (prefix, tree) in enumerate(zip((9, 14), parents, strict=True)):
        kv.add(f"r{i}", 40)
        kv.resize(f"r{i}", prefix + len(tree) + 1)
        seqs.append(SeqAttention(kv.slots(f"r{i}", 0, prefix + len(tree) + 1), len(tree) + 1, ancestor_mask(tree)))
    rec = Recorder()
    plan_paged(rec, kv, 2, seqs, causal=False)
    expected, indptr = pack_masks([visibility_mask(s, "cpu") for s in seqs])
    assert not rec.causal and torch.equal(rec.packed, expected)
    assert rec._mask_indptr_buf.tolist() == indptr == [0, 7 * 16 // 8, 7 * 16 // 8 + -(-(4 * 18) // 8)]
