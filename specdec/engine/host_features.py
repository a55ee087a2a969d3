"""A verify's features read on the host without a copy after its verdict (`TargetEngine.verify(...,
features_on_host=True)`: the target service, whose reply carries them in host memory anyway). Off unless
`SPECDEC_HOST_FEATURES=1` until its GPU test (`tests/gpu/test_host_features_gpu.py`) passes; its gain, measured on an
H100, is the verify phase 0.2-0.3 ms shorter at batch 1 (docs/benchmarks.md, forty-fifth pass).

The features a draft needs are the rows of the accepted paths, known only once the logits' argmax is on the host.
Gathered then, they cost a gather kernel, a device-to-host copy and a wait after the verdict, while the GPU idles
and the draft waits for the reply (~0.1-0.2 ms of a batch-1 verify of the 8B shape). Here every row of the forward is
copied to pinned host memory on a side stream as soon as the forward is queued, so the copy runs beside the lm_head
and argmax; after the verdict the accepted rows are read on the host. Copying all rows instead of the accepted ones
moves ~1.5-2x the bytes (a chain's), which the side stream hides behind the lm_head; a forward of more than
`STAGE_MAX_BYTES` of features (large batches of wide trees: ~13x the accepted rows' bytes at 64-token trees) keeps
the gather after the verdict. On a CPU the rows are the forward's own.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

# the most feature bytes a forward stages: ~0.15 ms of device-to-host copy, less than the lm_head of that many rows
# takes on the 8B shape (32 chains of 8 drafts: 2.4 MB; one 64-token tree: 0.5 MB)
STAGE_MAX_BYTES = 4 << 20


def staging_on() -> bool:
    """`SPECDEC_HOST_FEATURES=1` turns the staging on (read when an engine's stager is made)."""
    return os.environ.get("SPECDEC_HOST_FEATURES", "0") == "1"


class StagedRows:
    """Every row of one forward's features, on their way to host memory: `parts` joined by columns (the hidden
    state, or an EAGLE-3 feature's layers)."""

    def __init__(self, parts: list[torch.Tensor], stream: torch.cuda.Stream | None):
        self._parts = parts  # held until the copy has read them: no stream bookkeeping for the allocator
        if stream is None:
            self._host, self._done = _joined(parts), None  # [rows, feature_size], the forward's own memory
            return
        forward_done = torch.cuda.Event()
        forward_done.record()  # the forward, on the engine's stream
        with torch.cuda.stream(stream):
            stream.wait_event(forward_done)
            rows = _joined(parts)  # [rows, feature_size] (an EAGLE-3 feature's layers joined on the side stream)
            self._host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)  # [rows, feature_size]
            self._host.copy_(rows, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
            self._parts.append(rows)

    def host(self) -> torch.Tensor:
        """The rows in host memory (waits for the copy: by the verdict's sync it has run). # [rows, feature_size]"""
        if self._done is not None:
            self._done.synchronize()
            self._done, self._parts = None, []
        return self._host


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim=-1)


class FeatureStager:
    """Stages a forward's features for the host (`stage`), on one side stream per engine (none on a CPU). A
    staging that fails (a GPU or driver that refuses the side stream or the pinned buffer) is logged once and turns
    the staging off for this engine: the verify gathers its features on the device as before."""

    def __init__(self, device: torch.device, on: bool | None = None):
        self.device, self.on = device, staging_on() if on is None else on
        self._stream: torch.cuda.Stream | None = None

    def stage(self, parts: list[torch.Tensor]) -> StagedRows | None:
        """`parts` ([rows, width] each, joined by columns) staged, or None: staging off, or more than
        `STAGE_MAX_BYTES` of them."""
        if not self.on or sum(p.numel() * p.element_size() for p in parts) > STAGE_MAX_BYTES:
            return None
        try:
            if self.device.type == "cuda" and self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            return StagedRows(parts, self._stream)
        except Exception as exc:  # noqa: BLE001 - any failure: the device path, which needs none of this
            self.on = False
            log.warning("features are gathered on the device from now on: staging them for the host failed (%s)",
                        exc)
            return None
