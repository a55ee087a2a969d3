"""flashinfer attention over the paged cache (GPU): one BatchPrefillWithPagedKVCacheWrapper plan per forward,
shared by all layers. Tree verify, draft extend and draft tree steps pass the tail mask as flashinfer's custom
mask; batches with only causal sequences (prefill, plain decode) use its causal mode. Plain decode of a few
requests (and, for the target, chain verifies: `triton_queries`, and tree verifies: `triton_trees`) goes to the
Triton decode kernel instead, as in the captured graphs (`triton_decode.py`).

Each sequence's visible context is positions 0..L-1 of one request, so its pages are read straight off the
slot ids: page = slot // page_size at every page_size-th position.
"""

from __future__ import annotations

import builtins
import itertools
import weakref

import numpy as np
import torch

from specdec.attention import register_backend, triton_decode
from specdec.attention.batch import AttentionBatch, SeqAttention
from specdec.attention.torch_backend import visibility_mask
from specdec.host_copy import copy_in, host_tensor, staged, to_device

WORKSPACE_BYTES = 256 << 20


def _tensor_max(*args, **kwargs):
    """`max` as flashinfer's planner calls it: on a 1-D host tensor, torch's reduction (Python's `max` walks it
    element by element, a tensor comparison each: ~0.25 ms for 128 requests, twice a plan); else the builtin."""
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) and args[0].dim() == 1 \
            and args[0].numel():
        return args[0].max()
    return builtins.max(*args, **kwargs)


def import_flashinfer():
    """flashinfer, its prefill planner's module-level `max` replaced by `_tensor_max` (same values: the largest
    query and KV lengths of a batch, read with `.item()`)."""
    import flashinfer
    import flashinfer.prefill

    flashinfer.prefill.max = _tensor_max
    return flashinfer


class FlashInferAttention:
    name = "flashinfer"

    def __init__(self, kv_cache, num_qo_heads: int, triton_queries: int = 1, triton_trees: bool = False):
        flashinfer = import_flashinfer()

        self.kv, self.num_qo_heads = kv_cache, num_qo_heads
        dev = kv_cache.k.device
        if dev.type != "cuda":
            raise ValueError("the flashinfer backend needs a CUDA device (use --attention-backend torch on CPU)")
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        # fa2: flashinfer 0.5.3's SM90 (fa3) kernels reject custom masks ("operation not supported")
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD", backend="fa2")
        self._write_slots: torch.Tensor | None = None
        self._decode: triton_decode.TritonDecodeAttention | None = None  # this forward's, when it serves it
        # by (batch size, tokens per sequence, tree), kept across forwards
        self._decoders: dict[tuple[int, int, bool], triton_decode.TritonDecodeAttention] = {}
        # eager causal forwards of up to this many tokens per sequence may attend through the Triton kernel (the
        # target: chain verifies too, as its captured ones do; the draft: plain-decode shapes only, as before),
        # and with `triton_trees` small tree verifies (the target's)
        self.triton_queries, self.triton_trees = triton_queries, triton_trees

    def plan(self, batch: AttentionBatch) -> AttentionBatch:
        self._decode = None
        if triton_decode.takes(self.kv, batch.seqs, self.triton_queries, self.triton_trees):
            self._decode = self._decoder(batch.seqs)
            self._decode.plan(batch.seqs, batch.write_slots)
            return batch
        custom = any(s.tail_mask is not None for s in batch.seqs)
        plan_paged(self.wrapper, self.kv, self.num_qo_heads, batch.seqs, causal=not custom)
        self._write_slots = to_device(batch.write_slots, self.kv.k.device)
        return batch

    def _decoder(self, seqs: list[SeqAttention]) -> triton_decode.TritonDecodeAttention:
        """The Triton decode attention for this many sequences, its page table wide enough for them (its results
        do not depend on the width: a wider one is made only when a context outgrows the table)."""
        width = max(-(-s.ctx_slots.shape[0] // self.kv.page_size) for s in seqs)
        key = (len(seqs), seqs[0].num_q, any(s.tail_mask is not None for s in seqs))
        dec = self._decoders.get(key)
        if dec is None or dec.table.shape[1] < width:
            dec = self._decoders[key] = triton_decode.TritonDecodeAttention(
                self.kv, key[0], 2 * width, key[1], self.num_qo_heads, tree=key[2])
        return dec

    fuses_rope = True

    def forward(self, layer: int, q, k, v, batch: AttentionBatch, scale: float) -> torch.Tensor:
        if self._decode is not None:
            return self._decode.forward(layer, q, k, v, batch, scale)
        return paged_attention(self.wrapper, self.kv, layer, q, k, v, self._write_slots)

    def forward_rope(self, layer: int, q, k, v, rot, batch: AttentionBatch) -> torch.Tensor:
        if self._decode is not None:
            return self._decode.forward_rope(layer, q, k, v, rot, batch)
        return paged_attention(self.wrapper, self.kv, layer, q, k, v, self._write_slots, rot)


def plan_paged(wrapper, kv, num_qo_heads: int, seqs: list[SeqAttention], causal: bool) -> None:
    """Page tables (CSR: indptr, page ids, last-page lengths) and, unless causal, the visibility masks of
    `seqs`, handed to a flashinfer prefill wrapper (host side, once per forward or graph replay)."""
    lens, ps = [s.ctx_slots.shape[0] for s in seqs], kv.page_size
    # a page's id is its first slot's // page_size; ctx_slots run page by page, so every ps-th one starts a page
    # (one slice per sequence: a Python loop over 128 requests' ~4100 pages took 1.4 ms a plan against 0.35,
    # `bench/plan_host.py` on a 2-core CPU)
    plan_pages(wrapper, kv, num_qo_heads, [s.num_q for s in seqs], lens,
               lambda npages: torch.cat([s.ctx_slots[::ps] for s in seqs]) // ps,
               None if causal else [visibility_mask(s, "cpu") for s in seqs])


def plan_pages(wrapper, kv, num_qo_heads: int, num_q: list[int], lens: list[int], page_ids, masks=None) -> None:
    """plan_paged's core, for callers that know their page ids without slot tensors: sequence i has `num_q[i]`
    queries over a context of `lens[i]` positions; `page_ids(npages)` gets each sequence's page count and returns
    their page ids (all sequences, page order; a list or an int tensor). `masks`: each sequence's [num_q, len]
    visibility mask on the host (None: causal)."""
    ps = kv.page_size
    npages = [-(-n // ps) for n in lens]
    last = [n - (p - 1) * ps for n, p in zip(lens, npages, strict=True)]
    # The lengths go as host tensors: flashinfer reads them on the host anyway (device ones cost a sync each)
    # and copies them into its buffers without waiting (`host_copy.staged`: pinned when large). Page ids and
    # the packed masks go to the GPU: flashinfer copies host ones into a graph's buffers with a blocking copy.
    # Masks are packed here, on the host: flashinfer packs device masks on the GPU after reading their sizes
    # back (four syncs and a dozen small kernels a plan: ~0.7 ms of a 64-token tree's verify at batch 1,
    # twentieth pass).
    dev = kv.k.device

    def index(values, to="cpu") -> torch.Tensor:
        values = host_tensor(values, torch.int32)
        if to == "cpu":  # flashinfer's non-blocking copies from it never wait for the GPU
            return staged(values) if dev.type == "cuda" else values
        return to_device(values, to)

    packed, mask_indptr = (None, None) if masks is None else pack_masks(masks)
    _await_last_plan(wrapper)
    wrapper.plan(
        index([0, *itertools.accumulate(num_q)]), index([0, *itertools.accumulate(npages)]),
        index(page_ids(npages), dev), index(last), num_qo_heads, kv.k.shape[2], kv.k.shape[3], ps,
        packed_custom_mask=None if packed is None else to_device(packed, dev), causal=masks is None,
        sm_scale=kv.k.shape[3] ** -0.5, q_data_type=kv.k.dtype, kv_data_type=kv.k.dtype,
    )
    if mask_indptr is not None:
        _set_mask_indptr(wrapper, mask_indptr)
    if dev.type == "cuda":
        _planned[wrapper] = torch.cuda.Event()
        _planned[wrapper].record()


def pack_masks(masks: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The sequences' [num_q, len] bool masks as flashinfer's kernels read a custom mask: each one flattened row
    by row and packed 8 to a byte, least significant bit first (`flashinfer.segment_packbits(..., "little")`),
    every sequence starting on a byte of its own; and the byte offset where each starts (+ the total)."""
    parts = [np.packbits(m.reshape(-1).numpy(), bitorder="little") for m in masks]
    return torch.from_numpy(np.concatenate(parts)), [0, *itertools.accumulate(len(p) for p in parts)]


def _set_mask_indptr(wrapper, mask_indptr: list[int]) -> None:
    """Give the wrapper the byte offsets of the sequences' packed masks. Handed a packed mask, flashinfer 0.5.3's
    plan keeps offsets counted in bits (`_compute_page_mask_indptr`), while its kernels add them to a byte
    pointer: right for one sequence only (offset 0)."""
    if wrapper.is_cuda_graph_enabled:  # the captured kernels read this buffer
        copy_in(wrapper._mask_indptr_buf, host_tensor(mask_indptr, torch.int32))
    else:
        wrapper._mask_indptr_buf = to_device(mask_indptr, wrapper.device, torch.int32)


# A wrapper's plan leaves its work partition in the wrapper's pinned host buffer and queues a copy from there to
# the GPU. Nothing else makes the host wait for the GPU between two plans of one wrapper (every host-to-GPU copy of
# a plan is non-blocking), so the next plan first waits until that copy has run, or it would overwrite the buffer
# under it. The GPU is then at most one plan of that wrapper behind the host.
_planned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _await_last_plan(wrapper) -> None:
    done = _planned.pop(wrapper, None)
    if done is not None:
        done.synchronize()


def paged_attention(wrapper, kv, layer: int, q, k, v, write_slots: torch.Tensor, rot=None) -> torch.Tensor:
    """Write this forward's K/V at `write_slots`, then attend through the planned wrapper. With `rot` (a
    `Rotation`), q and k are not rotated yet: one fused kernel rotates them and writes K/V. # like q"""
    k_cache, v_cache = kv.k[layer], kv.v[layer]  # [num_slots, kv_heads, head_dim]
    if rot is not None:
        from specdec.kernels.rope import rope_store

        q = rope_store(q, k, v, rot.positions, rot.cos_table, rot.sin_table, k_cache, v_cache, write_slots)
    else:
        k_cache[write_slots] = k.to(k_cache.dtype)
        v_cache[write_slots] = v.to(v_cache.dtype)
    ps = kv.page_size
    paged = (k_cache.view(-1, ps, *k_cache.shape[1:]), v_cache.view(-1, ps, *v_cache.shape[1:]))
    return wrapper.run(q.to(k_cache.dtype), paged).to(q.dtype)


register_backend("flashinfer", FlashInferAttention)
