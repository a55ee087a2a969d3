"""CUDA-graph replay of the draft's tree proposal (topk k > 1): all `num_steps - 1` draft forwards of a batch, their
top-k and the frontier's choice at every depth (`draft_engine.grow`), as one graph per batch size; the host picks
each tree's best nodes from the candidates after the replay (`draft_engine.select`, the one sync).

The eager proposal keeps a frontier node's ancestors in temporary slots shared by the request's k frontier nodes
and builds each depth's mask on the host from the nodes chosen, so it waits for the GPU at every depth. Here each
frontier node has a *lane* instead: its own copy of the request's last, partly filled page, then its ancestors
and itself, one per depth, in pages of its own. A lane is then what a chain step attends over (the request's full
pages, then the lane's pages; `ChainStepAttention`, no mask), and choosing the next frontier copies the chosen
parents' lanes on the device (a few pages of one layer). Needs the Triton decode kernel (every CUDA machine torch
runs on); without it trees propose eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdec.engine.cuda_graphs import BATCH_LADDER
from specdec.engine.draft_engine import batch_state, grow, select
from specdec.engine.proposal_graphs import ProposalGraphs
from specdec.host_copy import copy_in
from specdec.tree import TokenTree

LANE_POOL_SHARE = 4  # lanes take at most 1 / this of the draft's KV pages (small pools capture fewer sizes)


@dataclass
class _TreeBuffers:
    """One batch size's inputs and outputs (B requests, k lanes each, lane r = request r // k)."""

    tokens0: torch.Tensor  # [B, k] the state's top-k tokens (the first frontier)
    scores0: torch.Tensor  # [B, k] float32 their draft probabilities
    hidden0: torch.Tensor  # [B, hidden] the state's hidden
    base: torch.Tensor  # [B * k] int64 each lane's request's cached draft length
    pos0: torch.Tensor  # [B * k] int64 position of each lane's request's next token
    table: torch.Tensor  # [B * k, max_pages] int32 each lane's pages: its request's full pages, then its own
    source: torch.Tensor  # [B * k] int64 the page each lane's first page starts as (its request's last page)
    lane_slots: torch.Tensor  # [B * k, lane_pages * page_size] int64 the K/V slots of each lane's own pages
    out_tokens: torch.Tensor  # [B, candidates] int64 every candidate's token (target id) ...
    out_scores: torch.Tensor  # [B, candidates] float32 ... score ...
    out_parents: torch.Tensor  # [B, candidates] int64 ... and parent candidate (-1: the root)
    graph: torch.cuda.CUDAGraph | None = None
    attn: list | None = None  # the graph's attention per depth: kept, their ticket counters are the graph's


class DraftTreeGraphs(ProposalGraphs):
    what = "tree-propose"

    def __init__(self, engine, max_batch_size: int, workspace: torch.Tensor | None, capture: bool = True):
        kv, spec = engine.kv, engine.spec
        k, ps = spec.topk, kv.page_size
        # a lane holds its request's last page (up to ps - 1 positions) and the num_steps - 1 nodes of its path
        self.lane_pages = -(-(ps - 1 + spec.num_steps - 1) // ps)
        most = kv.pool.num_total // LANE_POOL_SHARE
        super().__init__(engine, tuple(b for b in BATCH_LADDER
                                       if b <= max_batch_size and b * k * self.lane_pages <= most), workspace)
        self.pages = np.asarray(kv.set_aside(self.ladder[-1] * k * self.lane_pages), dtype=np.int32).reshape(
            self.ladder[-1] * k, self.lane_pages)  # each lane's own pages
        self.max_pages = -(-engine.max_context // ps) + self.lane_pages
        self.capture = capture  # False: run the same work eagerly (the CPU checks, under Triton's interpreter)
        self.candidates = k + (spec.num_steps - 1) * k * k

    # ---- propose --------------------------------------------------------------------------------------------
    def propose(self, rids: list[str], num_draft: int) -> list[TokenTree]:
        return super().propose(rids, num_draft) if self.capture else self._propose(rids, num_draft)

    def _propose(self, rids: list[str], num_draft: int) -> list[TokenTree]:
        eng = self.engine
        reqs = [eng.requests[r] for r in rids]
        b, k, ps = len(reqs), eng.spec.topk, eng.kv.page_size
        g = self.graphs[self.bucket(b)] if self.capture else self._buffers(self.bucket(b))
        lanes = g.base.shape[0]
        full = [r.kv_len // ps for r in reqs]  # each request's full pages; the next one is partly filled (or none)
        width = max(full, default=0) + self.lane_pages
        table = np.zeros((lanes, width), dtype=np.int32)
        source = self.pages[:lanes, 0].astype(np.int64)  # padding lanes: their own first page, left as it is
        for i, (rid, n) in enumerate(zip(rids, full, strict=True)):
            pages = eng.kv.table(rid).pages
            rows = slice(i * k, (i + 1) * k)
            table[rows, :n] = pages[:n]
            table[rows, n : n + self.lane_pages] = self.pages[rows]
            if len(pages) > n:
                source[rows] = pages[n]
        table[b * k :, : self.lane_pages] = self.pages[b * k : lanes]
        copy_in(g.table[:, :width], torch.from_numpy(table))
        copy_in(g.source, torch.from_numpy(source))
        pad = [0] * (lanes - b * k)
        copy_in(g.base, [r.kv_len for r in reqs for _ in range(k)] + pad)
        copy_in(g.pos0, [r.next_pos for r in reqs for _ in range(k)] + pad)
        state = batch_state(reqs)
        g.tokens0[:b].copy_(state.topk_index)
        g.scores0[:b].copy_(state.topk_p)
        g.hidden0[:b].copy_(state.hidden)
        if g.graph is not None:
            g.graph.replay()
        else:
            self._grow(g, self._attention(g))
        return select(g.out_tokens[:b], g.out_scores[:b], g.out_parents[:b], num_draft)

    # ---- the work of one proposal -----------------------------------------------------------------------------
    def _attention(self, g: _TreeBuffers) -> list:
        from specdec.attention.chain_step import ChainStepAttention  # imports Triton

        return [ChainStepAttention(self.engine.kv, g.table, g.base, d) for d in range(1, self.engine.spec.num_steps)]

    def _grow(self, g: _TreeBuffers, attn: list) -> None:
        eng = self.engine
        model, kv, k, steps = eng.model, eng.kv, eng.spec.topk, eng.spec.num_steps
        bsz, ps, lane_slots = g.tokens0.shape[0], kv.page_size, g.lane_slots
        first = lane_slots[:, :ps].reshape(-1)
        from_slots = (g.source.unsqueeze(-1) * ps + torch.arange(ps, device=lane_slots.device)).reshape(-1)
        for cache in (kv.k, kv.v):  # each lane starts with its request's last page
            cache[:, first] = cache[:, from_slots]
        f_tokens, f_scores = g.tokens0, g.scores0
        f_cand = torch.arange(k, device=f_tokens.device).expand(bsz, k)
        hid = g.hidden0.repeat_interleave(k, dim=0)  # [lanes, hidden]
        cands = [[f_tokens], [f_scores], [torch.full((bsz, k), -1, device=f_tokens.device)]]
        for d in range(1, steps):
            out = model(f_tokens.reshape(-1), hid, g.pos0 + (d - 1), attn[d - 1], None)  # [lanes, hidden]
            offset = k + (d - 1) * k * k
            children, (f_tokens, f_scores, f_cand, parent) = grow(*eng._topk(out), f_scores, f_cand, offset)
            for c, new in zip(cands, children, strict=True):
                c.append(new)
            if d == steps - 1:
                break
            rows = (parent + torch.arange(bsz, device=parent.device).unsqueeze(-1) * k).reshape(-1)  # [lanes]
            hid = out[rows]
            for cache in (kv.k, kv.v):  # each new frontier node's lane: its parent's
                cache[:, lane_slots] = cache[:, lane_slots[rows]]
        for buf, c in zip((g.out_tokens, g.out_scores, g.out_parents), cands, strict=True):
            buf.copy_(torch.cat(c, 1))

    # ---- capture --------------------------------------------------------------------------------------------
    def _buffers(self, bucket: int) -> _TreeBuffers:
        eng = self.engine
        k, dev = eng.spec.topk, eng.kv.k.device
        lanes = bucket * k
        table = torch.zeros(lanes, self.max_pages, dtype=torch.int32, device=dev)
        table[:, : self.lane_pages] = torch.from_numpy(self.pages[:lanes])  # padding lanes: their own pages
        own = torch.from_numpy(self.pages[:lanes].astype(np.int64))
        ps = eng.kv.page_size
        return _TreeBuffers(
            tokens0=torch.zeros(bucket, k, dtype=torch.int64, device=dev),
            scores0=torch.zeros(bucket, k, dtype=torch.float32, device=dev),
            hidden0=torch.zeros(bucket, eng.model.cfg.hidden_size, dtype=eng.dtype, device=dev),
            base=torch.zeros(lanes, dtype=torch.int64, device=dev),
            pos0=torch.zeros(lanes, dtype=torch.int64, device=dev),
            table=table,
            source=own[:, 0].to(dev),
            lane_slots=(own.unsqueeze(-1) * ps + torch.arange(ps)).view(lanes, -1).to(dev),
            out_tokens=torch.zeros(bucket, self.candidates, dtype=torch.int64, device=dev),
            out_scores=torch.zeros(bucket, self.candidates, dtype=torch.float32, device=dev),
            out_parents=torch.zeros(bucket, self.candidates, dtype=torch.int64, device=dev))

    @torch.inference_mode()
    def _capture(self, bucket: int) -> _TreeBuffers:
        from specdec.attention.graph_backend import capture_graph

        g = self._buffers(bucket)
        g.attn = self._attention(g)
        g.graph, _ = capture_graph(lambda: self._grow(g, g.attn), self.pool)
        return g

