"""CUDA-graph replay of the target forward for uniform batches: B requests x n new tokens each (plain decode:
n = 1; tree verify: n = num_draft_tokens + 1), with the flashinfer backend. Forwards at small batch (plain decode, chain
and tree verifies) attend through the one-kernel Triton decode attention instead when the contexts are short
(`attention/triton_decode.py`: a second set of graphs, `decode_graphs`, chosen per step;
`SPECDEC_DECODE_KERNEL=0`: flashinfer there too).

Graphs are captured for a ladder of batch sizes the first time a (n, aux layers, causal) shape is seen, largest
first, sharing one memory pool (causal: every request's new tokens are a chain, so no tree mask is packed or
applied); a batch is padded to the next captured size with requests that live in scratch pages.
Replay feeds the same inputs as an eager forward; `tests/gpu` checks replay == eager.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from specdec.attention import triton_decode
from specdec.attention.batch import SeqAttention
from specdec.attention.graph_backend import GraphAttention, capture_graph, capture_or_go_eager, scratch_slots
from specdec.host_copy import copy_in

log = logging.getLogger(__name__)

BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128)
# Largest captured forward (batch x tokens per request): flashinfer's split-KV scratch for a captured plan is sized
# for the whole shape (128 x 65 tokens needs ~810 MB); bigger batches are compute-bound and run eagerly.
MAX_GRAPH_TOKENS = 4096
WORKSPACE_BYTES = 512 << 20  # flashinfer's float scratch for split-KV partial results, shared by every graph


def ladder_for(ladder: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The captured batch sizes for n tokens per request: those within MAX_GRAPH_TOKENS (at least batch 1)."""
    return tuple(b for b in ladder if b * n <= MAX_GRAPH_TOKENS) or ladder[:1]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    attn: GraphAttention | triton_decode.TritonDecodeAttention
    io: torch.Tensor  # [2, B * n] int64: the ids row, then the positions row (one copy in for both)
    hidden: torch.Tensor  # [B * n, hidden]
    aux: torch.Tensor | None  # [B * n, len(aux) * hidden]

    @property
    def ids(self) -> torch.Tensor:
        return self.io[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.io[1]


class TargetGraphs:
    def __init__(self, model, kv, scratch_pages: list[int], max_context: int, max_batch_size: int):
        self.model, self.kv = model, kv
        self.scratch_pages = scratch_pages
        self.max_pages_per_seq = -(-max_context // kv.page_size) + 1
        self.ladder = tuple(b for b in BATCH_LADDER if b <= max_batch_size) or (1,)
        self.graphs: dict[tuple[int, int, tuple[int, ...], bool], _Graph] = {}
        # (bucket, n, aux, causal) of small shapes: the same forward attending through the Triton decode kernel
        self.decode_graphs: dict[tuple[int, int, tuple[int, ...], bool], _Graph] = {}
        self.failed: set[tuple[int, tuple[int, ...], bool]] = set()  # (n, aux, causal) whose capture failed: eager
        self._scratch_seqs: dict[tuple[int, bool], SeqAttention] = {}
        self.pool = None
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=kv.k.device)

    def usable(self, num_seqs: int, n: int, aux_layers: tuple[int, ...] = (), causal: bool = False) -> bool:
        return (num_seqs <= ladder_for(self.ladder, n)[-1] and n <= len(self.scratch_pages) * self.kv.page_size
                and (n, aux_layers, causal or n == 1) not in self.failed)

    def capture_startup(self) -> None:
        """Plain decode (1 token per request) for the whole ladder, at start-up."""
        with torch.cuda.device(self.kv.k.device):
            self._capture_ladder(1, (), True)

    def run(self, ids: list[int] | torch.Tensor, positions: torch.Tensor, seqs: list[SeqAttention],
            write_slots: torch.Tensor, n: int, aux_layers: tuple[int, ...], causal: bool = False, inputs_taken=None):
        """Same inputs and outputs as the eager forward (hidden [T, H], aux [T, A*H] or None), T = len(seqs) * n.
        `ids`: a list or a device tensor (the previous step's argmax); `positions`: on the host or the device
        (copied in without a host sync either way). `causal`: no sequence has a tree mask
        (chains, plain decode). `inputs_taken` (a CUDA event) is recorded after the inputs are copied in."""
        with torch.cuda.device(self.kv.k.device):  # capture and replay on the engine's GPU, whatever the thread's
            return self._run(ids, positions, seqs, write_slots, n, aux_layers, causal or n == 1, inputs_taken)

    def run_causal(self, ids: list[int] | torch.Tensor, positions: torch.Tensor, page_lists: list[list[int]],
                   lens: list[int], n: int, aux_layers: tuple[int, ...], inputs_taken=None):
        """`run` for causal sequences (chains, plain decode) from their page lists: sequence i's n new tokens sit
        at positions lens[i] - n .. lens[i] - 1 of the pages `page_lists[i]` (no slot tensors, no per-request
        tensor work on the host: at 128 requests that was most of a verify's host time)."""
        with torch.cuda.device(self.kv.k.device):
            g, pad = self._graph(len(lens), n, aux_layers, True, max(lens))
            g.attn.plan_causal(page_lists + [self.scratch_pages] * pad, lens + [n] * pad)
            return self._replay(g, ids, positions, len(lens) * n, n, pad, inputs_taken)

    def _run(self, ids, positions, seqs, write_slots, n, aux_layers, causal, inputs_taken):
        b = len(seqs)
        g, pad = self._graph(b, n, aux_layers, causal, max(s.ctx_slots.shape[0] for s in seqs))
        if pad:
            seqs = seqs + [self._scratch_seq(n, causal) for _ in range(pad)]
            write_slots = torch.cat([write_slots, self._scratch_slots(n).repeat(pad)])
        g.attn.plan(seqs, write_slots)
        return self._replay(g, ids, positions, b * n, n, pad, inputs_taken)

    def _graph(self, b: int, n: int, aux_layers: tuple[int, ...], causal: bool,
               max_len: int) -> tuple[_Graph, int]:
        """The captured graph for b requests of n tokens whose longest context is `max_len` positions (captured
        now if its shape is new), and its padding."""
        bucket = next(x for x in ladder_for(self.ladder, n) if x >= b)
        key = (bucket, n, aux_layers, causal)
        if key not in self.graphs:
            what = f"the target's {n}-token {'causal ' if causal else ''}forwards"
            capture_or_go_eager(lambda: self._capture_ladder(n, aux_layers, causal), what,
                                lambda: self._forget(n, aux_layers, causal))
        small = self.triton_graph(bucket, n, aux_layers, max_len, causal)
        return small or self.graphs[key], bucket - b

    def triton_graph(self, bucket: int, n: int, aux_layers: tuple[int, ...], max_len: int,
                     causal: bool = True) -> _Graph | None:
        """The Triton-decode graph a forward of `bucket` (padded) requests of n tokens (causal, or trees) whose
        longest context is `max_len` positions replays, or None (flashinfer's). Captured only where
        `triton_decode.serves` the batch size and n."""
        if max_len <= triton_decode.longest_context(n, tree=not causal):
            return self.decode_graphs.get((bucket, n, aux_layers, causal))
        return None

    @staticmethod
    def _replay(g: _Graph, ids, positions, t: int, n: int, pad: int, inputs_taken):
        """Copy the first t tokens' ids and positions in (padding rows: token 0 at positions 0..n-1), replay. Ids and
        positions from the host go in as one copy of both rows (padding included): each copy and fill is ~10-25 us
        of host time before the launch while the GPU waits (a batch-1 verify's pre-launch host time was ~0.3 ms)."""
        if isinstance(ids, list) and not (isinstance(positions, torch.Tensor) and positions.is_cuda):
            positions = positions.tolist() if isinstance(positions, torch.Tensor) else positions
            copy_in(g.io.view(-1), ids + [0] * (g.io.shape[1] - t) + positions + list(range(n)) * pad)
        else:  # ids on the device (the previous step's argmax)
            copy_in(g.ids[:t], ids)
            copy_in(g.positions[:t], positions)
            if pad:
                g.ids[t:].zero_()
                g.positions[t:].copy_(torch.arange(n, device=g.ids.device).repeat(pad))
        if inputs_taken is not None:
            inputs_taken.record()
        g.graph.replay()
        return g.hidden[:t], (g.aux[:t] if g.aux is not None else None)

    # ---- capture --------------------------------------------------------------------------------------------
    def _forget(self, n: int, aux_layers: tuple[int, ...], causal: bool) -> None:
        self.failed.add((n, aux_layers, causal))
        for k in [k for k in self.graphs if k[1:] == (n, aux_layers, causal)]:
            del self.graphs[k]
        for k in [k for k in self.decode_graphs if k[1:] == (n, aux_layers, causal)]:
            del self.decode_graphs[k]

    def _scratch_slots(self, n: int) -> torch.Tensor:
        return scratch_slots(self.scratch_pages, self.kv.page_size, n)

    def _scratch_seq(self, n: int, causal: bool) -> SeqAttention:
        """A padding request of n tokens (one object per shape, only read: making a 65-token mask with `torch.tril`
        cost 0.76 ms a call under cProfile on the H200's host, 9 us on a 2-core CPU; twenty-first pass)."""
        seq = self._scratch_seqs.get((n, causal))
        if seq is None:
            mask = None if causal else torch.ones(n, n, dtype=torch.bool).tril()
            seq = self._scratch_seqs[(n, causal)] = SeqAttention(self._scratch_slots(n), n, mask)
        return seq

    def _capture_ladder(self, n: int, aux_layers: tuple[int, ...], causal: bool) -> None:
        t0 = time.perf_counter()
        mem0 = torch.cuda.memory_allocated()
        ladder = ladder_for(self.ladder, n)
        for bucket in sorted(ladder, reverse=True):
            self.graphs[(bucket, n, aux_layers, causal)] = self._capture(bucket, n, aux_layers, causal)
        # short contexts of a few requests: the Triton decode attention, one more graph each
        for bucket in sorted((b for b in ladder if triton_decode.serves(self.kv, b, n, n, not causal)), reverse=True):
            self.decode_graphs[(bucket, n, aux_layers, causal)] = self._capture(bucket, n, aux_layers, causal, True)
        log.info("captured target CUDA graphs for n=%d tokens/request%s, batch sizes %s, aux %s in %.1f s "
                 "(+%.0f MiB)", n, " (causal)" if causal and n > 1 else "", list(ladder), list(aux_layers),
                 time.perf_counter() - t0, (torch.cuda.memory_allocated() - mem0) / 2**20)

    @torch.inference_mode()
    def _capture(self, bucket: int, n: int, aux_layers: tuple[int, ...], causal: bool,
                 triton: bool = False) -> _Graph:
        dev = self.kv.k.device
        if triton:
            attn = triton_decode.TritonDecodeAttention(self.kv, bucket, self.max_pages_per_seq, n,
                                                       self.model.cfg.num_heads, tree=not causal)
        else:
            attn = GraphAttention(self.kv, self.model.cfg.num_heads, bucket, n, self.max_pages_per_seq,
                                  self.workspace, causal)
        io = torch.stack([torch.zeros(bucket * n, dtype=torch.int64, device=dev),
                          torch.arange(n, device=dev).repeat(bucket)])
        ids, positions = io[0], io[1]
        attn.plan([self._scratch_seq(n, causal) for _ in range(bucket)], self._scratch_slots(n).repeat(bucket))
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph, out = capture_graph(lambda: self.model(ids, positions, attn, None, aux_layers), self.pool)
        return _Graph(graph, attn, io, out.hidden, out.aux)
