"""Host time of one flashinfer plan's page tables (`plan_paged`, without flashinfer's own planning), CPU only: B
requests of L tokens in a paged cache, a stand-in wrapper that keeps nothing.

    python bench/plan_host.py [--batch 128] [--tokens 500] [--repeats 50]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.attention.batch import SeqAttention  # noqa: E402
from specdec.attention.flashinfer_backend import plan_paged  # noqa: E402
from specdec.kv_cache import PagedKVCache  # noqa: E402


class NoPlan:
    def plan(self, *args, **kwargs) -> None:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=50)
    args = ap.parse_args(argv)
    page = 16
    kv = PagedKVCache(1, 1, 8, args.batch * (-(-args.tokens // page) + 1), page, torch.float32, "cpu")
    seqs = []
    for i in range(args.batch):
        kv.add(f"r{i}", args.tokens)
        kv.resize(f"r{i}", args.tokens)
        seqs.append(SeqAttention(kv.slots(f"r{i}", 0, args.tokens), 1))
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        plan_paged(NoPlan(), kv, 32, seqs, causal=True)
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"plan_paged, {args.batch} requests of {args.tokens} tokens: min {times[0] * 1e3:.3f} ms, "
          f"median {times[len(times) // 2] * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
