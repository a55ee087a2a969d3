"""Attention of one draft step inside the captured chain proposal, planned on the device.

Step d of a chain proposal is a one-token decode for every request: its query sits at position base + d - 1 (base
= the request's committed draft length) and sees positions 0..base + d - 1. The page table and `base` live in
device buffers the host fills once per proposal; each step derives its lengths and K/V write slots from them
inside the graph and attends with the plan-free Triton decode kernel (`specdec.kernels.paged_decode`). So a
proposal costs two small copies on the host, not a flashinfer plan per step.
"""

from __future__ import annotations

import torch

from specdec.kernels.paged_decode import decode_counters, store_and_attend


class ChainStepAttention:
    name = "chain-step"
    fuses_rope = True

    def __init__(self, kv_cache, table: torch.Tensor, base: torch.Tensor, step: int):
        self.kv = kv_cache
        self.table = table  # [B, max_pages] int32: each request's pages, in order
        self.base = base  # [B] int64: committed draft length of each request
        self.step = step  # d >= 1
        self.counters = decode_counters(table.shape[0], kv_cache.k.shape[2], table.device)

    def _where(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(lengths [B] int32 this step sees, K/V write slots [B] int64 of its query)."""
        ps = self.kv.page_size
        lens = self.base + self.step
        last = lens - 1
        page = self.table.gather(1, (last // ps).unsqueeze(1)).squeeze(1).to(torch.int64)
        return lens.to(torch.int32), page * ps + last % ps

    def forward_rope(self, layer: int, q, k, v, rot, batch) -> torch.Tensor:
        lens, slots = self._where()
        return store_and_attend(self.kv, layer, q, k, v, self.table, lens, slots, self.counters, rot=rot)

    def forward(self, layer: int, q, k, v, batch, scale: float) -> torch.Tensor:
        lens, slots = self._where()
        return store_and_attend(self.kv, layer, q, k, v, self.table, lens, slots, self.counters, scale=scale)
