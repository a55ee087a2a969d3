"""Host-to-GPU copies that never make the host wait for the GPU.

torch's blocking copy from host memory to a GPU (`tensor.to("cuda")`, `torch.tensor(values, device="cuda")`, a
`copy_` without `non_blocking`) synchronizes the stream after it: the host stops until every kernel queued before
has finished, so whatever it plans next (the next step's page tables, a graph launch) starts on an idle GPU. So
engines and attention planners copy non-blocking. Small copies (up to `PAGEABLE_BYTES`: ids, positions, page-table
rows) go straight from pageable memory, which the driver stages at once without waiting for the GPU; larger ones
through pinned memory (torch keeps the pinned block alive until its copy has run), where a pageable copy queued
behind GPU work waits for the driver's staging space. `python bench/host_copy_micro.py` on an H200 host: up to 4 KB,
7.4-8.4 us a copy pageable against 17.5-26.7 through `pin_memory()`, idle or 20 ms behind the GPU; at 64 KB,
15 / 59 us pageable (idle / behind) against 22 / 53-63 pinned (twentieth pass, docs/benchmarks.md).
`bench/sync_audit.py` lists the synchronizing calls left in an engine step.
"""

from __future__ import annotations

import array
import collections
import warnings
from pathlib import Path

import torch

SYNC_COPIES = False  # True: every copy here blocks like torch's default (bench/sync_audit.py's "before" rows)
PAGEABLE_BYTES = 4096  # copies up to this size skip pinning (measured above)
_ARRAY_CODES = {torch.int32: "i", torch.int64: "q"}


def host_tensor(values, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.as_tensor(values, dtype=dtype)`; a list of ints goes through `array.array`, which reads it ~3.5x
    faster (4100 page ids: ~100 us against ~340 on a 2-core CPU; a verify of 128 requests converts ~5000 ids)."""
    if type(values) is list and len(values) > 32 and type(values[0]) is int and dtype in (None, *_ARRAY_CODES):
        try:
            return torch.frombuffer(array.array(_ARRAY_CODES[dtype or torch.int64], values), dtype=dtype or torch.int64)
        except (TypeError, OverflowError):  # not all ints, or too large for the type: torch says what is wrong
            pass
    return torch.as_tensor(values, dtype=dtype)


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a list or a tensor) as a tensor on `device`, queued without a host sync when it is a GPU."""
    t = host_tensor(values, dtype)
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu" or SYNC_COPIES:
        return t.to(device)
    return staged(t).to(device, non_blocking=True)


def copy_in(dst: torch.Tensor, values) -> torch.Tensor:
    """`dst.copy_(values)` from the host (a list or a CPU tensor), queued without a host sync on a GPU."""
    src = host_tensor(values)
    if SYNC_COPIES:
        return dst.copy_(src)
    if dst.device.type == "cuda" and src.device.type == "cpu":
        src = staged(src)
    return dst.copy_(src, non_blocking=True)


def staged(t: torch.Tensor) -> torch.Tensor:
    """A host tensor ready for a non-blocking copy to a GPU: itself when small (or pinned already), else pinned."""
    if t.numel() * t.element_size() <= PAGEABLE_BYTES or t.is_pinned():
        return t
    return t.pin_memory()


def synchronizing_calls(fn) -> dict[str, int]:
    """Run `fn()` under `torch.cuda.set_sync_debug_mode("warn")` and count the synchronizing CUDA calls it makes,
    by the source line that made each (`folder/file.py:line`). Copies through this module make none."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    counts: collections.Counter = collections.Counter()
    for w in caught:
        if "synchroniz" in str(w.message):
            counts[f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}"] += 1
    return dict(counts)
