"""flashinfer attention with fixed-address buffers, so a whole target forward can be captured in a CUDA graph.

One instance per captured shape (B requests x n new tokens each, causal or with a tree mask). `plan(seqs)` (or
`plan_causal` from page lists) runs on the host before every replay and writes the page tables and mask into the
buffers the graph reads; `forward` (inside the graph) writes K/V at the slots in `write_slots` and runs the
attention. Shorter batches are padded with requests that live in
the engine's scratch pages.
"""

from __future__ import annotations

import gc
import itertools
import logging

import torch

from specdec.attention.batch import SeqAttention
from specdec.attention.flashinfer_backend import import_flashinfer, paged_attention, plan_paged, plan_pages
from specdec.errors import ConfigError
from specdec.host_copy import copy_in

log = logging.getLogger(__name__)


class GraphAttention:
    name = "flashinfer-graph"

    def __init__(self, kv_cache, num_qo_heads: int, batch_size: int, tokens_per_seq: int, max_pages_per_seq: int,
                 workspace: torch.Tensor, causal: bool = False):
        flashinfer = import_flashinfer()

        self.kv, self.num_qo_heads = kv_cache, num_qo_heads
        self.batch_size, self.n = batch_size, tokens_per_seq
        dev = kv_cache.k.device
        i32 = dict(dtype=torch.int32, device=dev)
        # causal: no custom mask (one query per request, or chains: query i sees the prefix and queries 0..i)
        self.causal = causal or tokens_per_seq == 1
        max_ctx = max_pages_per_seq * kv_cache.page_size
        self.workspace = workspace  # shared by all captured shapes: they never run at the same time
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(batch_size + 1, **i32), paged_kv_indptr_buf=torch.zeros(batch_size + 1, **i32),
            paged_kv_indices_buf=torch.zeros(batch_size * max_pages_per_seq, **i32),
            paged_kv_last_page_len_buf=torch.zeros(batch_size, **i32),
            custom_mask_buf=None if self.causal else torch.zeros(
                batch_size * (tokens_per_seq * max_ctx + 7) // 8 + batch_size, dtype=torch.uint8, device=dev),
            mask_indptr_buf=None if self.causal else torch.zeros(batch_size + 1, **i32),
            backend="fa2",
        )
        self.write_slots = torch.zeros(batch_size * tokens_per_seq, dtype=torch.int64, device=dev)

    def plan(self, seqs: list[SeqAttention], write_slots: torch.Tensor) -> None:
        """Host side, before capture or replay: seqs has exactly `batch_size` entries of `n` queries each."""
        plan_paged(self.wrapper, self.kv, self.num_qo_heads, seqs, self.causal)
        copy_in(self.write_slots, write_slots)

    def plan_causal(self, page_lists: list[list[int]], lens: list[int]) -> None:
        """`plan` for causal sequences of `n` queries each, from page lists: sequence i's queries are positions
        lens[i]-n..lens[i]-1 of the pages `page_lists[i]`, write their K/V there, and query j sees positions
        0..lens[i]-n+j. Python lists throughout: no per-sequence tensor work on the host."""
        ps, n = self.kv.page_size, self.n
        assert self.causal
        plan_pages(self.wrapper, self.kv, self.num_qo_heads, [n] * len(lens), lens,
                   lambda npages: list(itertools.chain.from_iterable(
                       pages[:k] for pages, k in zip(page_lists, npages, strict=True))))
        write = [pages[p // ps] * ps + p % ps for pages, end in zip(page_lists, lens, strict=True)
                 for p in range(end - n, end)]
        copy_in(self.write_slots, write)

    fuses_rope = True

    def forward(self, layer: int, q, k, v, batch, scale: float) -> torch.Tensor:
        return paged_attention(self.wrapper, self.kv, layer, q, k, v, self.write_slots)

    def forward_rope(self, layer: int, q, k, v, rot, batch) -> torch.Tensor:
        return paged_attention(self.wrapper, self.kv, layer, q, k, v, self.write_slots, rot)


def scratch_slots(pages: list[int], page_size: int, n: int) -> torch.Tensor:
    """Slots of positions 0..n-1 of the scratch pages that padded (fake) requests of a captured batch use."""
    pos = torch.arange(n)
    return torch.tensor(pages)[pos // page_size] * page_size + pos % page_size


DISABLE_HINT = "start with --disable-cuda-graph to run without CUDA graphs"


class GraphCaptureError(RuntimeError):
    """A CUDA graph could not be captured; the engine runs that shape eagerly from then on."""


def capture_or_go_eager(capture, what: str, forget) -> None:
    """Run `capture()`; if it fails, `forget()` what it left, log it naming the flag, raise GraphCaptureError."""
    try:
        capture()
    except Exception as exc:  # noqa: BLE001 - any failure: that shape runs eagerly from now on
        forget()
        log.error("CUDA graph capture of %s failed (%s: %s); it runs eagerly from now on (%s)", what,
                  type(exc).__name__, exc, DISABLE_HINT)
        raise GraphCaptureError(str(exc)) from exc


def capture_at_startup(graphs, who: str) -> None:
    """Capture `graphs`' start-up shapes now, so a failure stops start-up with a clear message."""
    try:
        graphs.capture_startup()
    except Exception as exc:  # noqa: BLE001 - any capture failure is reported the same way
        raise ConfigError(f"{who}: CUDA graph capture failed ({type(exc).__name__}: {exc}); {DISABLE_HINT}") from exc


def capture_graph(body, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm `body` up twice on a side stream (lazy inits, autotuning), then capture it into `pool`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # No garbage collection while capturing: an engine collected then (tests build and drop them) destroys its graphs
    # mid-capture ("operation not permitted when stream is capturing (function reset)" warnings at the failures),
    # and the capture fails ("operation failed due to a previous error during capture"). `tests/gpu` lost the
    # EAGLE-3 draft's chain capture so in 3 of 4 runs without this guard and in 0 of 2 with it (session 13).
    collecting = gc.isenabled()
    gc.disable()
    try:
        # our own stream: torch's default capture stream is one per process, made on whichever GPU captured first
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = body()
    finally:
        if collecting:
            gc.enable()
    return graph, out
