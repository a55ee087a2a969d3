"""Reference attention: gathers each sequence's K/V from the paged cache and runs SDPA with an explicit mask.

Runs on CPU and GPU; it is the ground truth the flashinfer backend is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.attention.batch import AttentionBatch, SeqAttention


class TorchAttention:
    name = "torch"

    def __init__(self, kv_cache, num_qo_heads: int = 0, triton_queries: int = 1, triton_trees: bool = False):
        self.kv = kv_cache  # (`triton_queries`: the flashinfer backend's; every forward attends in torch here)

    def plan(self, batch: AttentionBatch) -> AttentionBatch:
        """Per-forward preparation shared by all layers: slot ids and masks on the cache's device."""
        dev = self.kv.k.device
        if batch.write_slots.device == dev:
            return batch
        seqs = [SeqAttention(s.ctx_slots.to(dev), s.num_q, None if s.tail_mask is None else s.tail_mask.to(dev))
                for s in batch.seqs]
        return AttentionBatch(seqs, batch.write_slots.to(dev))

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        batch: AttentionBatch,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]
        k_cache[batch.write_slots] = k.to(k_cache.dtype)
        v_cache[batch.write_slots] = v.to(v_cache.dtype)
        out = torch.empty_like(q)
        start = 0
        for seq in batch.seqs:
            end = start + seq.num_q
            out[start:end] = _attend_one(q[start:end], k_cache, v_cache, seq, scale)
            start = end
        return out


def _attend_one(q, k_cache, v_cache, seq: SeqAttention, scale: float) -> torch.Tensor:
    keys = k_cache[seq.ctx_slots].to(q.dtype)  # [ctx, num_kv_heads, head_dim]
    values = v_cache[seq.ctx_slots].to(q.dtype)
    mask = visibility_mask(seq, q.device)  # [num_q, ctx]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=keys.shape[1] != q.shape[1],
    )  # [heads, num_q, head_dim]
    return out.transpose(0, 1)


def visibility_mask(seq: SeqAttention, device) -> torch.Tensor:
    """[num_q, ctx_len] bool: True where query i may attend to context slot j."""
    tail = seq.tail_mask
    if tail is None:
        tail = torch.ones(seq.num_q, seq.num_q, dtype=torch.bool, device=device).tril_()
    prefix = torch.ones(seq.num_q, seq.num_prefix, dtype=torch.bool, device=device)
    return torch.cat([prefix, tail.to(device)], dim=1)
