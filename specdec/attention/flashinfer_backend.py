"""flashinfer attention over the paged cache (GPU): one BatchPrefillWithPagedKVCacheWrapper plan per forward,
shared by all layers. Tree verify, draft extend and draft tree steps pass the tail mask as flashinfer's custom
mask; batches with only causal sequences (prefill, plain decode) use its causal mode.

Each sequence's visible context is positions 0..L-1 of one request, so its pages are read straight off the
slot ids: page = slot // page_size at every page_size-th position.
"""

from __future__ import annotations

import torch

from specdec.attention import register_backend
from specdec.attention.batch import AttentionBatch, SeqAttention
from specdec.attention.torch_backend import visibility_mask

WORKSPACE_BYTES = 256 << 20


class FlashInferAttention:
    name = "flashinfer"

    def __init__(self, kv_cache, num_qo_heads: int):
        import flashinfer

        self.kv, self.num_qo_heads = kv_cache, num_qo_heads
        dev = kv_cache.k.device
        if dev.type != "cuda":
            raise ValueError("the flashinfer backend needs a CUDA device (use --attention-backend torch on CPU)")
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        # fa2: flashinfer 0.5.3's SM90 (fa3) kernels reject custom masks ("operation not supported")
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD", backend="fa2")
        self._write_slots: torch.Tensor | None = None

    def plan(self, batch: AttentionBatch) -> AttentionBatch:
        custom = any(s.tail_mask is not None for s in batch.seqs)
        plan_paged(self.wrapper, self.kv, self.num_qo_heads, batch.seqs, causal=not custom)
        self._write_slots = batch.write_slots.to(self.kv.k.device, non_blocking=True)
        return batch

    fuses_rope = True

    def forward(self, layer: int, q, k, v, batch: AttentionBatch, scale: float) -> torch.Tensor:
        return paged_attention(self.wrapper, self.kv, layer, q, k, v, self._write_slots)

    def forward_rope(self, layer: int, q, k, v, rot, batch: AttentionBatch) -> torch.Tensor:
        return paged_attention(self.wrapper, self.kv, layer, q, k, v, self._write_slots, rot)


def plan_paged(wrapper, kv, num_qo_heads: int, seqs: list[SeqAttention], causal: bool) -> None:
    """Page tables (CSR: indptr, page ids, last-page lengths) and, unless causal, the visibility masks of
    `seqs`, handed to a flashinfer prefill wrapper (host side, once per forward or graph replay)."""
    ps, dev = kv.page_size, kv.k.device
    qo, kv_ptr, pages, last, masks = [0], [0], [], [], []
    for s in seqs:
        seq_pages = s.ctx_slots[::ps] // ps
        pages.append(seq_pages)
        qo.append(qo[-1] + s.num_q)
        kv_ptr.append(kv_ptr[-1] + seq_pages.shape[0])
        last.append(s.ctx_slots.shape[0] - (seq_pages.shape[0] - 1) * ps)
        if not causal:
            masks.append(visibility_mask(s, "cpu").reshape(-1))

    # Causal plans take host tensors: flashinfer reads the lengths on the host anyway (device ones cost a sync
    # each) and copies them into its buffers. With a custom mask it packs the mask on the GPU from device ones.
    where = "cpu" if causal else dev

    def index(values) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int32).to(where, non_blocking=True)

    wrapper.plan(
        index(qo), index(kv_ptr), index(torch.cat(pages)), index(last),
        num_qo_heads, kv.k.shape[2], kv.k.shape[3], ps,
        custom_mask=None if causal else torch.cat(masks).to(dev, non_blocking=True), causal=causal,
        sm_scale=kv.k.shape[3] ** -0.5, q_data_type=kv.k.dtype, kv_data_type=kv.k.dtype,
    )


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
