"""Programmatic dependent launch (PDL, Hopper and later) for this package's Triton kernels.

A kernel launched with PDL may have its CTAs scheduled while the kernel before it in the stream still runs; each
waits at its start (`pdl_enter`: `griddepcontrol.wait`) until that kernel has finished and its writes are
visible, then lets the next kernel's CTAs be scheduled in turn. What it saves is the gap between two kernels: a
batch-1 decode step of the 8B shape is ~290 kernels in one graph replay, and the kernels' own times summed to
~0.2 ms less than the step (H200, seventeenth pass). Every kernel here calls `pdl_enter` before it reads or
writes anything, so the wait is transitive: a kernel starts after the end of the one before it, which started
after the end of the one before that. Kernels of other libraries between them (cuBLAS, flashinfer, torch) launch
as usual and so wait as usual. The arithmetic is unchanged (bit-identical results; tested on the GPU).
Used on GPUs of compute capability 9.0 and later with a torch built for CUDA 12.4 or later; `SPECDEC_PDL=0` turns
it off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from specdec.kernels import interpreted

MIN_CUDA = (12, 4)  # CUDA graphs keep a captured launch's programmatic dependency from 12.3 on


@functools.cache
def _pdl_on(device_index: int) -> bool:
    if os.environ.get("SPECDEC_PDL", "1") == "0" or interpreted():
        return False
    cuda = getattr(tl.extra, "cuda", None)
    if cuda is None or not hasattr(cuda, "gdc_wait") or not hasattr(cuda, "gdc_launch_dependents"):
        return False
    return cuda_at_least(torch.version.cuda, MIN_CUDA) and torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def early_weights() -> bool:
    """Whether a projection kernel launched with PDL (`gemv.py`, `skinny.py`) reads its first weight chunk before it
    waits for the kernel before it (`SPECDEC_GEMV_EARLY=0`: after; a benchmark's switch)."""
    return os.environ.get("SPECDEC_GEMV_EARLY", "1") != "0"


def cuda_at_least(version: str | None, least: tuple[int, int]) -> bool:
    """Whether a CUDA version string ("12.4", "13.0"; None for a CPU build) is at least `least`."""
    if not version:
        return False
    try:
        return tuple(int(x) for x in version.split(".")[:2]) >= least
    except ValueError:
        return False


def launch_dependent(t: torch.Tensor) -> bool:
    """Whether the kernels launch with PDL on `t`'s device (the `PDL` constexpr and `launch_pdl` of a launch)."""
    return t.is_cuda and _pdl_on(t.device.index)  # (a CUDA tensor's device always has its index)


def pdl_options(t: torch.Tensor) -> dict:
    """A launch's keyword arguments for a kernel with a `PDL` constexpr, on `t`'s device."""
    return {"PDL": True, "launch_pdl": True} if launch_dependent(t) else {"PDL": False}


def projection_options(t: torch.Tensor) -> dict:
    """`pdl_options` for a projection kernel (`gemv.py`, `skinny.py`), with its `EARLY` constexpr: under PDL it
    reads its first weight chunk before the wait (`early_weights`)."""
    launch = pdl_options(t)
    return {**launch, "EARLY": launch["PDL"] and early_weights()}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First thing in a kernel launched with PDL: wait for the kernel before it, then let the next one be
    scheduled (its CTAs wait in their own `pdl_enter`)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
