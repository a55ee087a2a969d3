"""Engine entry points run with the engine's GPU current: CUDA's current device is per thread, and flashinfer,
Triton and CUDA-graph capture launch on it. With this, one thread can drive a target on one GPU and a draft on
another (in-process `generate`), and a worker thread can verify for a draft on another GPU (two-batch overlap).
An engine's device always names its GPU (`resolve_device`)."""

from __future__ import annotations

import functools

import torch


def resolve_device(device: str | torch.device) -> torch.device:
    """The device with its GPU named: `cuda` (what `--device cuda` and the Helm chart's `device=cuda` pass) is the
    current CUDA device, e.g. `cuda:0`. Without an index `torch.cuda.set_device` refuses it, and two-batch
    overlap's verify worker makes the engine's GPU current that way (its thread failed to start, and every verify
    of a micro-batch with it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


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
