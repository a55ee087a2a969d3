"""Host time of one small host-to-GPU copy, three ways (none may wait for the GPU):

    python bench/host_copy_micro.py [--sizes 16,256,4096,65536] [--copies 2000]

- `pin`: what `specdec.host_copy` does, `src.pin_memory()` then a non-blocking copy (torch's caching host
  allocator hands out a pinned block and records an event on it for the copy);
- `pageable`: a non-blocking copy straight from the pageable tensor (the driver stages it);
- `ring`: a copy from a slice of one pinned buffer allocated once, reused round robin (an event per slot, waited
  on before the slot is reused).
Each way's copies are checked to land (the destination equals the source) and timed on an idle GPU and behind a
queue of matrix products (`--busy-ms`), where a copy that waits for the GPU shows up as milliseconds.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def busy(ms: float) -> None:
    """Queue about `ms` of GPU work."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    a @ a
    torch.cuda.synchronize()
    one = time.perf_counter() - t0
    for _ in range(max(1, int(ms / 1e3 / one))):
        a @ a


class Ring:
    def __init__(self, slots: int, slot_bytes: int):
        self.buf = torch.empty(slots * slot_bytes, dtype=torch.uint8, pin_memory=True)
        self.slot_bytes, self.events, self.next = slot_bytes, [None] * slots, 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        i = self.next
        self.next = (i + 1) % len(self.events)
        if self.events[i] is not None:
            self.events[i].synchronize()
        n = src.numel() * src.element_size()
        view = self.buf[i * self.slot_bytes : i * self.slot_bytes + n].view(src.dtype)
        view.copy_(src.reshape(-1))
        dst.copy_(view.view(src.shape), non_blocking=True)
        ev = self.events[i] = torch.cuda.Event()
        ev.record()


def run(way: str, nbytes: int, copies: int, ring: Ring, busy_ms: float) -> dict:
    src = torch.arange(max(1, nbytes // 8), dtype=torch.int64)
    dsts = [torch.empty_like(src, device="cuda") for _ in range(copies)]
    for _ in range(2):  # warm
        one(way, dsts[0], src, ring)
    torch.cuda.synchronize()
    if busy_ms:
        busy(busy_ms)
    t0 = time.perf_counter()
    for d in dsts:
        one(way, d, src, ring)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    ok = all(torch.equal(d.cpu(), src) for d in dsts[:: max(1, copies // 20)])
    return {"way": way, "bytes": src.numel() * 8, "gpu_busy_ms": busy_ms,
            "host_us_per_copy": round(host / copies * 1e6, 2), "landed": ok}


def one(way: str, dst: torch.Tensor, src: torch.Tensor, ring: Ring) -> None:
    if way == "pin":
        dst.copy_(src.pin_memory(), non_blocking=True)
    elif way == "pageable":
        dst.copy_(src, non_blocking=True)
    else:
        ring.copy(dst, src)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="16,256,4096,65536")
    ap.add_argument("--copies", type=int, default=200)
    ap.add_argument("--busy-ms", default="0,20", help="GPU work queued before each timed batch of copies")
    ap.add_argument("--out", default="host_copy_micro.json")
    args = ap.parse_args()
    ring = Ring(256, 1 << 16)
    rows = []
    for busy_ms in (float(x) for x in args.busy_ms.split(",")):
        for nbytes in (int(x) for x in args.sizes.split(",")):
            for way in ("pin", "pageable", "ring", "pin"):
                rows.append(run(way, nbytes, args.copies, ring, busy_ms))
                print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
