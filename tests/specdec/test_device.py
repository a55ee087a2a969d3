"""`resolve_device`: an engine's (and two-batch overlap's) device always names its GPU."""

from __future__ import annotations

import torch

from specdec.engine.device import resolve_device
from specdec.engine.overlap import TwoBatchOverlap
from specdec.serving.engine_loop import EngineLoop


def test_cuda_without_an_index_becomes_the_current_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")
    # the overlap's verify worker makes this device current with torch.cuda.set_device, which refuses "cuda"
    assert TwoBatchOverlap(4, "cuda").device == torch.device("cuda", 3)
    # and so does each service's engine thread at its start (not started here)
    assert EngineLoop(None, "engine", "cuda").device == torch.device("cuda", 3)


def test_cpu_engines_keep_their_device():
    assert resolve_device(torch.device("cpu")).type == "cpu"
    assert TwoBatchOverlap(4, "cpu").device == torch.device("cpu")


def test_pdl_needs_a_recent_cuda_build():
    from specdec.kernels.pdl import MIN_CUDA, cuda_at_least

    assert MIN_CUDA == (12, 4)
    assert cuda_at_least("13.0", MIN_CUDA) and cuda_at_least("12.4", MIN_CUDA) and cuda_at_least("12.10", MIN_CUDA)
    assert not cuda_at_least("12.1", MIN_CUDA) and not cuda_at_least(None, MIN_CUDA)
    assert not cuda_at_least("", MIN_CUDA) and not cuda_at_least("rocm", MIN_CUDA)
