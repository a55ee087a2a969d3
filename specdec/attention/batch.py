"""What one forward pass needs to know about attention: which cache slots each sequence sees, and the mask.

A batch concatenates the new tokens of several sequences. For each sequence, the visible context is
`ctx_slots` in position order: a prefix every new token sees in full, then a tail of `tail_len` slots whose
visibility is given by `tail_mask` (None = causal over the new tokens, which are then the whole tail).

Worked example: a tree verify over a committed prefix of 5 tokens with root r and draft nodes a (parent r),
b (parent r), c (parent a). New tokens [r, a, b, c] are written to positions 5..8; ctx_slots covers 0..8,
num_prefix = 5, and tail_mask is the ancestor-or-self matrix
    r: 1 0 0 0
    a: 1 1 0 0
    b: 1 0 1 0
    c: 1 1 0 1
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SeqAttention:
    ctx_slots: torch.Tensor  # [ctx_len] int64 cache slots, position order
    num_q: int  # new tokens of this sequence in the batch
    tail_mask: torch.Tensor | None = None  # [num_q, tail_len] bool, or None for causal (tail_len == num_q)

    @property
    def tail_len(self) -> int:
        return self.num_q if self.tail_mask is None else self.tail_mask.shape[1]

    @property
    def num_prefix(self) -> int:
        return self.ctx_slots.shape[0] - self.tail_len


@dataclass
class AttentionBatch:
    seqs: list[SeqAttention]
    write_slots: torch.Tensor  # [num_tokens] int64: where each new token's K/V goes

    @property
    def num_tokens(self) -> int:
        return self.write_slots.shape[0]
