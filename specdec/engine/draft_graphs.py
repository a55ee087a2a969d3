"""CUDA-graph replay of the draft's chain proposal (topk == 1): all `num_steps - 1` draft forwards of a batch,
with their argmax and d2t mapping, as one graph per batch size.

For a chain, draft step d of a request is a one-token decode in K/V slot kv_len + d - 1 (at position
next_pos + d - 1: the two differ by the positions the draft skipped) over the request's cached prefix and the
d - 1 chain tokens before it. With Triton (every CUDA machine torch runs on) the steps attend through
`ChainStepAttention`: the host writes the page table and the committed lengths once, each step derives its own
lengths inside the graph. Without it, each step's flashinfer plan is made on the host before the replay.
Captured for the batch ladder on first use, padded with requests that live in scratch pages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.attention.batch import SeqAttention
from specdec.attention.graph_backend import GraphAttention, capture_graph, scratch_slots
from specdec.engine.cuda_graphs import BATCH_LADDER
from specdec.engine.draft_engine import batch_state
from specdec.engine.proposal_graphs import ProposalGraphs
from specdec.host_copy import copy_in
from specdec.kernels import attention_fused, fused
from specdec.tree import TokenTree

WORKSPACE_BYTES = 512 << 20  # flashinfer split-KV scratch: the batch-128 extend (768 tokens, 8B head) needs 316 MB


@dataclass
class _ChainGraph:
    graph: torch.cuda.CUDAGraph
    attn: list  # one per draft step: GraphAttention (planned on the host) or ChainStepAttention
    tokens0: torch.Tensor  # [B] the state's top-1 token (level 1 of the chain)
    hidden0: torch.Tensor  # [B, hidden] the state's hidden
    base: torch.Tensor  # [B] int64 cached draft length of each request; step d's query is K/V slot base + d - 1
    pos0: torch.Tensor  # [B] int64 position of each request's next token (base + its skipped positions)
    table: torch.Tensor | None  # [B, max_pages] int32 page table (ChainStepAttention only)
    out_tokens: torch.Tensor  # [B, steps] chain tokens, level 1 first


class DraftChainGraphs(ProposalGraphs):
    what = "chain-propose"

    def __init__(self, engine, max_batch_size: int, workspace: torch.Tensor):
        super().__init__(engine, tuple(b for b in BATCH_LADDER if b <= max_batch_size), workspace)
        kv, steps = engine.kv, engine.spec.num_steps
        self.scratch_pages = kv.set_aside(-(-steps // kv.page_size))
        self.max_pages_per_seq = -(-(engine.max_context + steps) // kv.page_size) + 1
        self.device_planned = fused(kv.k) and attention_fused(kv.k.shape[-1])  # Triton: ChainStepAttention

    def _propose(self, rids: list[str], num_draft: int) -> list[TokenTree]:
        """Chains of the first `num_draft` tokens (a chain's scores fall along it: its best nodes)."""
        eng = self.engine
        steps = eng.spec.num_steps
        reqs = [eng.requests[r] for r in rids]
        b = len(reqs)
        bucket = self.bucket(b)
        g = self.graphs[bucket]
        for rid, req in zip(rids, reqs, strict=True):
            eng.kv.resize(rid, req.kv_len + steps - 1)
        pad = bucket - b
        # step d: each request's query sits in K/V slot kv_len + d - 1 (position next_pos + d - 1) and sees slots
        # 0..kv_len + d - 1; padding requests do the same over the scratch pages from slot 0
        pages = [eng.kv.table(rid).pages for rid in rids] + [self.scratch_pages] * pad
        base = [r.kv_len for r in reqs] + [0] * pad
        if g.table is not None:
            width = max(map(len, pages))
            copy_in(g.table[:, :width], torch.tensor([p + [0] * (width - len(p)) for p in pages], dtype=torch.int32))
        else:
            for d in range(1, steps):
                g.attn[d - 1].plan_causal(pages, [n + d for n in base])
        copy_in(g.base, base)
        copy_in(g.pos0, [r.next_pos for r in reqs] + [0] * pad)
        state = batch_state(reqs)
        g.tokens0[:b].copy_(state.topk_index[:, 0])
        g.hidden0[:b].copy_(state.hidden)
        g.graph.replay()
        for rid, req in zip(rids, reqs, strict=True):
            eng.kv.resize(rid, req.kv_len)
        parents = tuple(range(-1, num_draft - 1))
        return [TokenTree(tuple(row), parents) for row in g.out_tokens[:b, :num_draft].tolist()]

    # ---- capture --------------------------------------------------------------------------------------------
    def _scratch_slots(self, n: int) -> torch.Tensor:
        return scratch_slots(self.scratch_pages, self.engine.kv.page_size, n)

    def _scratch_seq(self, n: int) -> SeqAttention:
        return SeqAttention(self._scratch_slots(n), 1, torch.ones(1, 1, dtype=torch.bool))

    @torch.inference_mode()
    def _capture(self, bucket: int) -> _ChainGraph:
        eng = self.engine
        model, steps, dev = eng.model, eng.spec.num_steps, eng.kv.k.device
        base = torch.zeros(bucket, dtype=torch.int64, device=dev)
        pos0 = torch.zeros(bucket, dtype=torch.int64, device=dev)
        table = None
        if self.device_planned:
            from specdec.attention.chain_step import ChainStepAttention  # imports Triton

            table = torch.full((bucket, self.max_pages_per_seq), self.scratch_pages[0], dtype=torch.int32,
                               device=dev)
            table[:, : len(self.scratch_pages)] = torch.tensor(self.scratch_pages, dtype=torch.int32)
            attn = [ChainStepAttention(eng.kv, table, base, d) for d in range(1, steps)]
        else:
            attn = [GraphAttention(eng.kv, model.cfg.num_heads, bucket, 1, self.max_pages_per_seq, self.workspace)
                    for _ in range(steps - 1)]
            for d in range(1, steps):
                attn[d - 1].plan([self._scratch_seq(d)] * bucket, self._scratch_slots(d)[-1:].repeat(bucket))
        tokens0 = torch.zeros(bucket, dtype=torch.int64, device=dev)
        hidden0 = torch.zeros(bucket, model.cfg.hidden_size, dtype=eng.dtype, device=dev)
        out_tokens = torch.zeros(bucket, steps, dtype=torch.int64, device=dev)

        def body():
            tok, hid, outs = tokens0, hidden0, [tokens0]
            for d in range(1, steps):
                out = model(tok, hid, pos0 + (d - 1), attn[d - 1], None)  # [B, hidden]
                tok = model.to_target_ids(model.compute_logits(out).argmax(-1))
                hid = out
                outs.append(tok)
            out_tokens.copy_(torch.stack(outs, dim=1))

        graph, _ = capture_graph(body, self.pool)
        return _ChainGraph(graph, attn, tokens0, hidden0, base, pos0, table, out_tokens)
