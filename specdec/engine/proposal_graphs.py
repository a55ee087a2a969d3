"""What the draft's captured proposals (chains: `draft_graphs`, trees: `draft_tree_graphs`) share: a ladder of batch
sizes captured largest first into one memory pool, on the first proposal or at start-up, and eager proposals from
then on if a capture fails."""

from __future__ import annotations

import logging
import time

import torch

from specdec.attention.graph_backend import capture_or_go_eager
from specdec.tree import TokenTree

log = logging.getLogger(__name__)


class ProposalGraphs:
    what = "proposal"  # for the logs

    def __init__(self, engine, ladder: tuple[int, ...], workspace: torch.Tensor):
        self.engine = engine
        self.ladder = ladder or (1,)
        self.graphs: dict = {}  # batch size -> that size's captured graph and its buffers
        self.failed = False  # a capture failed: proposals run eagerly from now on
        self.pool = None
        self.workspace = workspace  # flashinfer's split-KV scratch, shared with the draft's other graphs

    def usable(self, num_requests: int) -> bool:
        return 0 < num_requests <= self.ladder[-1] and not self.failed

    def capture_startup(self) -> None:
        with torch.cuda.device(self.engine.kv.k.device):
            self._capture_ladder()

    @torch.inference_mode()  # the buffers are made in inference mode (at capture)
    def propose(self, rids: list[str], num_draft: int) -> list[TokenTree]:
        """The best `num_draft` nodes of each request's tree (GraphCaptureError if the ladder cannot be captured)."""
        with torch.cuda.device(self.engine.kv.k.device):  # capture and replay on the engine's GPU
            if not self.graphs:
                capture_or_go_eager(self._capture_ladder, f"the draft's {self.what}", self._forget)
            return self._propose(rids, num_draft)

    def bucket(self, num_requests: int) -> int:
        return next(x for x in self.ladder if x >= num_requests)

    def _forget(self) -> None:
        self.failed, self.graphs = True, {}

    def _capture_ladder(self) -> None:
        t0, mem0 = time.perf_counter(), torch.cuda.memory_allocated()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for bucket in sorted(self.ladder, reverse=True):
            self.graphs[bucket] = self._capture(bucket)
        log.info("captured draft %s CUDA graphs for batch sizes %s in %.1f s (+%.0f MiB)", self.what,
                 list(self.ladder), time.perf_counter() - t0, (torch.cuda.memory_allocated() - mem0) / 2**20)

    def _propose(self, rids: list[str], num_draft: int) -> list[TokenTree]:
        raise NotImplementedError

    def _capture(self, bucket: int):
        raise NotImplementedError
