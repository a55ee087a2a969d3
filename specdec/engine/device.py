"""Engine entry points run with the engine's GPU current: CUDA's current device is per thread, and flashinfer,
Triton and CUDA-graph capture launch on it. With this, one thread can drive a target on one GPU and a draft on
another (in-process `generate`), and a worker thread can verify for a draft on another GPU (two-batch overlap)."""

from __future__ import annotations

import functools

import torch


def engine_call(method):
    """`torch.inference_mode()`, plus `torch.cuda.device(self.device)` for an engine on a GPU."""
    method = torch.inference_mode()(method)

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)

    return call
