"""flashinfer attention over the paged cache (GPU): one BatchPrefillWithPagedKVCacheWrapper plan per forward,
shared by all layers. Tree verify, draft extend and draft tree steps pass the tail mask as flashinfer's custom
mask; batches with only causal sequences (prefill, plain decode) use its causal mode.

Each sequence's visible context is positions 0..L-1 of one request, so its pages are read straight off the
slot ids: page = slot // page_size at every page_size-th position.
"""

from __future__ import annotations

import torch

from specdec.attention import register_backend
from specdec.attention.batch import AttentionBatch
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
        self._planned: AttentionBatch | None = None
        self._write_slots: torch.Tensor | None = None

    def plan(self, batch: AttentionBatch) -> AttentionBatch:
        kv, ps = self.kv, self.kv.page_size
        qo, kv_ptr, pages, last = [0], [0], [], []
        masks = []
        custom = any(s.tail_mask is not None for s in batch.seqs)
        for s in batch.seqs:
            n_ctx = s.ctx_slots.shape[0]
            seq_pages = s.ctx_slots[::ps] // ps
            pages.append(seq_pages)
            qo.append(qo[-1] + s.num_q)
            kv_ptr.append(kv_ptr[-1] + seq_pages.shape[0])
            last.append(n_ctx - (seq_pages.shape[0] - 1) * ps)
            if custom:
                masks.append(visibility_mask(s, "cpu").reshape(-1))
        dev = kv.k.device
        mask = torch.cat(masks).to(dev, non_blocking=True) if custom else None

        def on_dev(values) -> torch.Tensor:  # flashinfer packs custom masks on the GPU from these
            return torch.tensor(values, dtype=torch.int32).to(dev, non_blocking=True)

        self.wrapper.plan(
            on_dev(qo), on_dev(kv_ptr), torch.cat(pages).to(torch.int32).to(dev, non_blocking=True), on_dev(last),
            self.num_qo_heads, kv.k.shape[2], kv.k.shape[3], ps, custom_mask=mask, causal=not custom,
            sm_scale=kv.k.shape[3] ** -0.5, q_data_type=kv.k.dtype, kv_data_type=kv.k.dtype,
        )
        self._write_slots = batch.write_slots.to(dev, non_blocking=True)
        return batch

    def forward(self, layer: int, q, k, v, batch: AttentionBatch, scale: float) -> torch.Tensor:
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]  # [num_slots, kv_heads, head_dim]
        k_cache[self._write_slots] = k.to(k_cache.dtype)
        v_cache[self._write_slots] = v.to(v_cache.dtype)
        ps = self.kv.page_size
        paged = (k_cache.view(-1, ps, *k_cache.shape[1:]), v_cache.view(-1, ps, *v_cache.shape[1:]))
        return self.wrapper.run(q.to(k_cache.dtype), paged).to(q.dtype)


register_backend("flashinfer", FlashInferAttention)
