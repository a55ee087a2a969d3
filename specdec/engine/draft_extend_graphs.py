"""CUDA-graph replay of the draft's extend after a verify step: every request's committed tokens (at most
`num_draft_tokens + 1`) run through the head in one graph per batch size, with the top-k of the last token's
distribution, so the step costs one plan, a few copies and one replay instead of ~30 eager launches.

Shapes are fixed: each request gets T = num_draft_tokens + 1 query rows. A request with n < T new tokens is
padded after them: the padding rows sit at positions past the n real ones, write K/V into the request's own slots
past its new length (freed again at once, never seen: causal attention lets real rows see only earlier
positions) and their outputs are dropped. Batches are padded to the next captured size with requests that live
in scratch pages. Extends that do not fit (prompts, long catch-ups, a request at the end of its KV reservation)
run eagerly, as without graphs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from specdec.attention.graph_backend import GraphAttention, capture_graph, capture_or_go_eager
from specdec.engine.cuda_graphs import BATCH_LADDER, MAX_GRAPH_TOKENS
from specdec.host_copy import copy_in, to_device

log = logging.getLogger(__name__)


@dataclass
class _ExtendGraph:
    graph: torch.cuda.CUDAGraph
    attn: GraphAttention
    ids: torch.Tensor  # [B * T] int64
    feats: torch.Tensor  # [B * T, feature_size]
    positions: torch.Tensor  # [B * T] int64
    last: torch.Tensor  # [B] int64: each request's last real row
    topk_p: torch.Tensor  # [B, topk]
    topk_index: torch.Tensor  # [B, topk] target ids
    hidden: torch.Tensor  # [B, hidden]


class DraftExtendGraphs:
    def __init__(self, engine, max_batch_size: int, workspace: torch.Tensor):
        self.engine = engine
        kv = engine.kv
        self.tokens = engine.spec.num_draft_tokens + 1  # T: query rows per request
        self.scratch_pages = kv.set_aside(-(-self.tokens // kv.page_size))
        self.max_pages_per_seq = -(-(engine.max_context + 2 * self.tokens) // kv.page_size) + 1
        self.ladder = tuple(b for b in BATCH_LADDER
                            if b <= max_batch_size and b * self.tokens <= MAX_GRAPH_TOKENS) or (1,)
        self.graphs: dict[int, _ExtendGraph] = {}
        self.failed = False  # a capture failed: extends run eagerly from now on
        self.pool = None
        self.workspace = workspace

    def usable(self, items) -> bool:
        """Whether these (request id, tokens, features) items fit a captured extend."""
        if self.failed or not 0 < len(items) <= self.ladder[-1]:
            return False
        eng, ps = self.engine, self.engine.kv.page_size
        return all(0 < len(tokens) <= self.tokens and
                   -(-(eng.requests[rid].kv_len + self.tokens) // ps) <= eng.kv.table(rid).reserved_pages
                   for rid, tokens, _ in items)

    def capture_startup(self) -> None:
        with torch.cuda.device(self.engine.kv.k.device):
            self._capture_ladder()

    def extend(self, items) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The eager extend's effect (K/V written, lengths advanced) for items that are `usable`; returns the new
        draft state rows (topk_p [n, topk], topk_index [n, topk], hidden [n, hidden]), in item order."""
        with torch.cuda.device(self.engine.kv.k.device):  # capture and replay on the engine's GPU
            if not self.graphs:
                capture_or_go_eager(self._capture_ladder, "the draft's extend", self._forget)
            return self._extend(items)

    def _extend(self, items):
        eng, t = self.engine, self.tokens
        b = len(items)
        bucket = next(x for x in self.ladder if x >= b)
        g = self.graphs[bucket]
        pages, lens, ids, pos, last, rows = [], [], [], [], [], []
        for i, (rid, tokens, _) in enumerate(items):
            req, n = eng.requests[rid], len(tokens)
            start, p0 = req.kv_len, req.next_pos  # K/V slots and positions (they differ after `skip`)
            eng.kv.resize(rid, start + t)
            pages.append(eng.kv.table(rid).pages)
            lens.append(start + t)
            ids += [*tokens, *[0] * (t - n)]
            pos += [*range(p0, p0 + n), *[p0 + n - 1] * (t - n)]
            last.append(i * t + n - 1)
            rows += range(i * t, i * t + n)
        pad = bucket - b
        pages += [self.scratch_pages] * pad
        lens += [t] * pad
        ids += [0] * (pad * t)
        pos += list(range(t)) * pad
        last += [b * t] * pad
        g.attn.plan_causal(pages, lens)
        copy_in(g.ids, ids)
        copy_in(g.positions, pos)
        copy_in(g.last, last)
        where = items[0][2].device
        feats = torch.cat([f.to(where) for _, _, f in items]).to(g.feats.device, g.feats.dtype, non_blocking=True)
        g.feats.index_copy_(0, to_device(rows, g.feats.device), feats)
        g.graph.replay()
        for rid, tokens, _ in items:
            req = eng.requests[rid]
            req.kv_len += len(tokens)
            eng.kv.resize(rid, req.kv_len)  # the padding rows' slots go back
        # copies: the next replay of this graph (another micro-batch's extend) overwrites its outputs
        return g.topk_p[:b].clone(), g.topk_index[:b].clone(), g.hidden[:b].clone()

    # ---- capture --------------------------------------------------------------------------------------------
    def _forget(self) -> None:
        self.failed, self.graphs = True, {}

    def _capture_ladder(self) -> None:
        t0, mem0 = time.perf_counter(), torch.cuda.memory_allocated()
        for bucket in sorted(self.ladder, reverse=True):
            self.graphs[bucket] = self._capture(bucket)
        log.info("captured draft extend CUDA graphs (%d tokens/request) for batch sizes %s in %.1f s (+%.0f MiB)",
                 self.tokens, list(self.ladder), time.perf_counter() - t0,
                 (torch.cuda.memory_allocated() - mem0) / 2**20)

    @torch.inference_mode()
    def _capture(self, bucket: int) -> _ExtendGraph:
        eng, t = self.engine, self.tokens
        model, dev = eng.model, eng.kv.k.device
        attn = GraphAttention(eng.kv, model.cfg.num_heads, bucket, t, self.max_pages_per_seq, self.workspace, True)
        attn.plan_causal([self.scratch_pages] * bucket, [t] * bucket)
        ids = torch.zeros(bucket * t, dtype=torch.int64, device=dev)
        feats = torch.zeros(bucket * t, model.feature_size, dtype=eng.dtype, device=dev)
        positions = torch.arange(t, device=dev).repeat(bucket)
        last = torch.arange(bucket, device=dev) * t + t - 1

        def body():
            h = model(ids, feats, positions, attn, None)[last]  # [B, hidden]: each request's last real row
            return (*eng._topk(h), h)

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph, (topk_p, topk_index, hidden) = capture_graph(body, self.pool)
        return _ExtendGraph(graph, attn, ids, feats, positions, last, topk_p, topk_index, hidden)
