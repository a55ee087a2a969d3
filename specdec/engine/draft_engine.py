"""The draft side: extend the EAGLE head's KV over committed tokens, and propose token trees (EAGLE-2 growth).

Per-request draft state after an extend: `topk_p` [topk] and `topk_index` [topk] (target ids) of the head's
distribution for the token after the last committed one, and `hidden` [hidden], the head's output there.

Tree growth for one request (topk K, num_steps S, num_draft_tokens D):
  level 1: the K candidates of the state, score = draft probability; all K form the frontier.
  level d (2..S): one draft forward over the K frontier nodes (each sees the prefix and its own ancestors);
    each yields K children with score = parent score x child probability; the K best of the K*K children form
    the next frontier.
  Finally the D best candidates by score (ties: earlier first) form the tree. A child's score never exceeds its
  parent's and parents are generated earlier, so the chosen set is closed under parents.
Draft K/V of frontier nodes live in temporary slots after the request's committed length and are dropped after
the proposal; the committed tokens are re-run by the next extend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.attention import AttentionBatch, SeqAttention, make_backend
from specdec.attention.graph_backend import GraphCaptureError
from specdec.engine.device import engine_call, resolve_device
from specdec.errors import ConfigError, DuplicateRequest, UnknownRequest
from specdec.host_copy import to_device
from specdec.kernels import attention_fused, fused
from specdec.kv_cache import PagedKVCache
from specdec.models.eagle import EagleDraft
from specdec.tree import TokenTree


@dataclass(frozen=True)
class SpecConfig:
    num_steps: int = 5
    topk: int = 1
    num_draft_tokens: int = 5

    def validate(self) -> SpecConfig:
        if self.num_steps < 1 or self.topk < 1 or self.num_draft_tokens < 1:
            raise ConfigError("num_steps, topk and num_draft_tokens must all be >= 1")
        most = self.topk + (self.num_steps - 1) * self.topk * self.topk
        if self.num_draft_tokens > most:
            raise ConfigError(
                f"num_draft_tokens {self.num_draft_tokens} exceeds what {self.num_steps} steps of topk "
                f"{self.topk} can grow ({most})"
            )
        return self


@dataclass
class DraftState:
    """The draft state of the requests of one extend, as rows of batch tensors (one per extend, not per request)."""

    topk_p: torch.Tensor  # [n, topk]
    topk_index: torch.Tensor  # [n, topk] target ids
    hidden: torch.Tensor  # [n, hidden]


@dataclass
class DraftRequest:
    kv_len: int  # positions with K/V in the draft's cache
    state: DraftState | None = None
    row: int = 0  # this request's row of `state`
    skipped: int = 0  # committed positions left out of the cache (`skip`): the next position is kv_len + skipped

    @property
    def next_pos(self) -> int:
        return self.kv_len + self.skipped

    @property
    def topk_p(self) -> torch.Tensor:  # [topk]
        return self.state.topk_p[self.row]

    @property
    def topk_index(self) -> torch.Tensor:  # [topk]
        return self.state.topk_index[self.row]

    @property
    def hidden(self) -> torch.Tensor:  # [hidden]
        return self.state.hidden[self.row]


def batch_state(reqs: list[DraftRequest]) -> DraftState:
    """The states of `reqs` as one batch: without copies when they come from one extend, in that order (the
    common case: the whole batch was extended together), one gather when from one extend in another order."""
    first = reqs[0].state
    if all(r.state is first for r in reqs):
        rows = [r.row for r in reqs]
        if rows == list(range(first.hidden.shape[0])):
            return first
        idx = torch.tensor(rows, device=first.hidden.device)
        return DraftState(first.topk_p[idx], first.topk_index[idx], first.hidden[idx])
    return DraftState(torch.stack([r.topk_p for r in reqs]), torch.stack([r.topk_index for r in reqs]),
                      torch.stack([r.hidden for r in reqs]))


class DraftEngine:
    def __init__(
        self,
        model: EagleDraft,
        spec: SpecConfig,
        num_pages: int,
        page_size: int = 16,
        attention_backend: str = "torch",
        max_context: int = 2048,
        device: str | torch.device = "cpu",
        cuda_graphs: bool = False,
        max_batch_size: int = 64,
    ):
        self.model, self.spec, self.device = model, spec.validate(), resolve_device(device)
        cfg = model.cfg
        self.dtype = next(model.parameters()).dtype
        self.kv = PagedKVCache(1, cfg.num_kv_heads, cfg.head_dim, num_pages, page_size, self.dtype, device)
        self.backend = make_backend(attention_backend, self.kv, cfg.num_heads)
        self.max_context = max_context
        self.requests: dict[str, DraftRequest] = {}
        self.graphs = self.extend_graphs = None
        if cuda_graphs:
            from specdec.engine.draft_extend_graphs import DraftExtendGraphs
            from specdec.engine.draft_graphs import WORKSPACE_BYTES, DraftChainGraphs

            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)  # never used at once
            if spec.topk == 1 and spec.num_steps > 1:
                self.graphs = DraftChainGraphs(self, max_batch_size, workspace)
            elif spec.num_steps > 1 and fused(self.kv.k) and attention_fused(cfg.head_dim):  # trees need Triton
                from specdec.engine.draft_tree_graphs import DraftTreeGraphs

                self.graphs = DraftTreeGraphs(self, max_batch_size, workspace)
            self.extend_graphs = DraftExtendGraphs(self, max_batch_size, workspace)

    @property
    def _reserved(self) -> int:
        """KV pages promised to running requests."""
        return self.kv.reserved_by_requests

    @property
    def temp_slots(self) -> int:
        return (self.spec.num_steps - 1) * self.spec.topk

    def add(self, rid: str, max_total_len: int, prompt_len: int | None = None) -> None:
        if rid in self.requests:
            raise DuplicateRequest(f"request {rid!r} is already running on the draft")
        slots = self.temp_slots + 1  # a proposal's temporary nodes, and the root's
        fixed = None if prompt_len is None else prompt_len + slots
        self.kv.add(rid, min(max_total_len, self.max_context) + slots, "draft KV pool", fixed)
        self.requests[rid] = DraftRequest(0)

    def release(self, rid: str) -> None:
        if self.requests.pop(rid, None) is None:
            raise UnknownRequest(f"unknown request id {rid!r}")
        self.kv.release(rid)

    def length(self, rid: str) -> int:
        """The request's committed length as the draft knows it (positions in its cache and skipped ones)."""
        return self.requests[rid].next_pos

    def skip(self, rid: str, n: int) -> None:
        """Leave the next `n` committed positions out of the draft's cache (tokens decoded plainly that the draft
        does not catch up on): later extends continue at their true positions and attend over what is cached.
        Proposals stay valid (the target verifies them) and lose only the skipped context."""
        self.requests[rid].skipped += n

    def settle(self) -> None:
        """Wait until the GPU has run everything queued on this draft's device (its extends run asynchronously:
        timing one to its end, or starting a step's timer without inheriting it, needs this)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- extend -------------------------------------------------------------------------------------------
    @engine_call
    def extend(self, items: list[tuple[str, list[int], torch.Tensor]]) -> None:
        """items: (request id, tokens [n], target features [n, feature_size]) pairs; token i pairs with the
        feature of the position before it. Updates each request's draft state."""
        if self.extend_graphs is not None and self.extend_graphs.usable(items):
            try:
                state = DraftState(*self.extend_graphs.extend(items))
            except GraphCaptureError:
                pass  # logged by the graphs; extends run eagerly from now on
            else:
                for i, (rid, _, _) in enumerate(items):
                    self.requests[rid].state, self.requests[rid].row = state, i
                return
        ids, pos, seqs, slots, feats, lasts = [], [], [], [], [], []
        for rid, tokens, features in items:
            req = self.requests[rid]
            n = len(tokens)
            self.kv.resize(rid, req.kv_len + n)
            ctx = self.kv.slots(rid, 0, req.kv_len + n)
            ids += tokens
            pos += range(req.next_pos, req.next_pos + n)
            seqs.append(SeqAttention(ctx, n))
            slots.append(ctx[req.kv_len :])
            feats.append(features.to(self.device, self.dtype))  # no copy when already there
            req.kv_len += n
            lasts.append(len(ids) - 1)
        batch = self.backend.plan(AttentionBatch(seqs, torch.cat(slots)))
        out = self.model(to_device(ids, self.device), torch.cat(feats), to_device(pos, self.device), self.backend,
                         batch)  # [num_tokens, hidden]
        last_hidden = out[to_device(lasts, self.device)]  # [num_items, hidden]
        state = DraftState(*self._topk(last_hidden), last_hidden)
        for i, (rid, _, _) in enumerate(items):
            req = self.requests[rid]
            req.state, req.row = state, i

    def _topk(self, hidden: torch.Tensor):
        probs = torch.softmax(self.model.compute_logits(hidden), dim=-1)  # [n, draft_vocab]
        p, idx = torch.topk(probs, self.spec.topk, dim=-1)
        return p, self.model.to_target_ids(idx)

    # ---- propose ------------------------------------------------------------------------------------------
    @engine_call
    def propose(self, rids: list[str], num_draft_tokens: int | None = None) -> list[TokenTree]:
        """A tree per request: its best `num_draft_tokens` nodes (default and maximum: the spec's). A chain's best
        n nodes are its first n levels, so an eager chain proposal runs only n steps (the captured one runs all)."""
        size = min(num_draft_tokens or self.spec.num_draft_tokens, self.spec.num_draft_tokens)
        if self.graphs is not None and self.graphs.usable(len(rids)):
            try:
                return self.graphs.propose(rids, size)
            except GraphCaptureError:
                for rid in rids:  # logged by the graphs; undo the replay's temporary slots, then go eager
                    self.kv.resize(rid, self.requests[rid].kv_len)
        k, steps = self.spec.topk, self.spec.num_steps
        if k == 1:  # a chain's best `size` nodes are its first `size` levels: the deeper steps are not run
            steps = min(steps, size)
        reqs = [self.requests[r] for r in rids]
        b = len(reqs)
        state = batch_state(reqs)
        f_tokens = state.topk_index  # [b, k] frontier tokens
        f_scores = state.topk_p.float()  # [b, k]
        f_hidden = state.hidden.unsqueeze(1).expand(b, k, -1)  # [b, k, hidden]
        dev = f_tokens.device
        f_cand = torch.arange(k, device=dev).expand(b, k)  # [b, k] candidate index of each frontier node
        cand_tokens, cand_scores, cand_parents = [f_tokens], [f_scores], [torch.full((b, k), -1, device=dev)]
        # temp-slot indices of each frontier node's fed ancestors and itself, on the host (masks are built there)
        ancestors = torch.arange(k).view(1, k, 1).expand(b, k, 1)  # [b, k, depth]
        for depth in range(1, steps):
            out = self._step(rids, reqs, f_tokens, f_hidden, depth, ancestors)  # [b, k, hidden]
            children, (f_tokens, f_scores, f_cand, parent_slot) = grow(
                *self._topk(out.reshape(b * k, -1)), f_scores, f_cand, sum(t.shape[1] for t in cand_tokens))
            for cands, new in zip((cand_tokens, cand_scores, cand_parents), children, strict=True):
                cands.append(new)
            f_hidden = torch.gather(out, 1, parent_slot.to(out.device).unsqueeze(-1).expand(-1, -1, out.shape[-1]))
            parent_cpu = parent_slot.cpu()  # one host sync per depth
            inherited = torch.gather(ancestors, 1, parent_cpu.unsqueeze(-1).expand(-1, -1, ancestors.shape[2]))
            own = (depth * k + torch.arange(k)).view(1, k, 1).expand(b, k, 1)
            ancestors = torch.cat([inherited, own], dim=2)
        for rid, req in zip(rids, reqs, strict=True):
            self.kv.resize(rid, req.kv_len)  # drop the temporary tree slots
        return select(torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1), torch.cat(cand_parents, 1), size)

    def _step(self, rids, reqs, tokens, hidden, depth: int, ancestors: torch.Tensor) -> torch.Tensor:
        """Draft forward over the frontier (nodes at `depth`); `ancestors` [b, k, depth] (CPU) are the temp slots
        each frontier node sees. Returns their outputs. # [b, k, hidden]"""
        k = self.spec.topk
        b = len(reqs)
        seqs, slots = [], []
        # [b, k, depth * k]: frontier node j of request i sees the temp slots of its ancestors and itself
        masks = torch.zeros(b, k, depth * k, dtype=torch.bool).scatter_(2, ancestors, True)
        for i, (rid, req) in enumerate(zip(rids, reqs, strict=True)):
            self.kv.resize(rid, req.kv_len + depth * k)
            ctx = self.kv.slots(rid, 0, req.kv_len + depth * k)
            seqs.append(SeqAttention(ctx, k, masks[i]))
            slots.append(ctx[req.kv_len + (depth - 1) * k :])
        positions = torch.tensor([r.next_pos + depth - 1 for r in reqs]).repeat_interleave(k)
        batch = self.backend.plan(AttentionBatch(seqs, torch.cat(slots)))
        out = self.model(to_device(tokens.reshape(-1), self.device), hidden.reshape(b * k, -1),
                         to_device(positions, self.device), self.backend, batch)
        return out.view(b, k, -1)


def grow(p: torch.Tensor, idx: torch.Tensor, f_scores: torch.Tensor, f_cand: torch.Tensor, offset: int):
    """One level of tree growth for a batch of b requests with frontiers of k nodes: p, idx [b * k, k] (each
    frontier node's top-k draft probabilities and their target ids), f_scores [b, k] (float32) and f_cand [b, k]
    (the nodes' candidate indices); `offset`: the candidates so far. Returns the k * k children (tokens, scores =
    parent score x probability, parents: candidate indices), each [b, k * k], and the next frontier (tokens,
    scores, candidate indices, and which node of this frontier each one's parent is), each [b, k]."""
    b, k = f_scores.shape
    tokens = idx.view(b, k * k)
    scores = (f_scores.unsqueeze(-1) * p.view(b, k, k).float()).reshape(b, k * k)
    parents = f_cand.unsqueeze(-1).expand(b, k, k).reshape(b, k * k)
    sel = torch.topk(scores, k, dim=-1).indices  # [b, k] the best children
    frontier = (torch.gather(tokens, 1, sel), torch.gather(scores, 1, sel), offset + sel, sel // k)
    return (tokens, scores, parents), frontier


def select(tokens, scores, parents, num_draft_tokens: int) -> list[TokenTree]:
    """Best `num_draft_tokens` candidates per request, in generation order, parents remapped (one copy to the
    host)."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :num_draft_tokens]
    chosen = torch.sort(order, dim=1).values
    picked = torch.stack([chosen, tokens.gather(1, chosen), parents.gather(1, chosen)]).tolist()
    trees = []
    for row_chosen, row_tokens, row_parents in zip(*picked, strict=True):
        new_index = {c: i for i, c in enumerate(row_chosen)}
        trees.append(TokenTree(tuple(row_tokens), tuple(new_index[p] if p >= 0 else -1 for p in row_parents)))
    return trees
