"""The 8B shape's projections at a few rows (batch-1 decode, a chain verify): torch's `linear` (cuBLAS) against
Triton kernels, each timed inside a CUDA graph over weight copies larger than the L2 cache, as GB/s of weights read.
One row: the shipped `specdec.kernels.gemv` at its own config (`shipped_GBps`) and a sweep of its configs; more rows:
a tensor-core kernel for skinny products (rows padded to 16; it lost to cuBLAS on three of five shapes at 6 rows,
session 14, so nothing ships for them). Issue 6: the GEMMs were ~88% of copy bandwidth in a batch-1 forward.

    python bench/gemv_micro.py [--rows 1,6] [--shapes qkv,o] [--out gemv.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.kernels.gemv import _gemv_kernel, config, gemv  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096),  # the 8B target; then the EAGLE-3 head's own (fc, midlayer qkv, lm_head)
          "e3_fc": (4096, 12288), "e3_qkv": (6144, 8192), "e3_lm_head": (32000, 4096)}


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    m_ok = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptrs, mask=m_ok, other=0.0)  # [BLOCK_M, BLOCK_K]
        acc += tl.dot(x, tl.trans(w))
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok)


def skinny(x, w, out, block_n, block_k, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    _skinny_kernel[(n // block_n,)](x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
                                    BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)


def one_row(x, w, out, block_n, block_k, warps, stages):
    """The shipped one-row kernel (`specdec.kernels.gemv`) at a given config."""
    n, k = w.shape
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, w, out, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                              num_warps=warps, num_stages=stages, PDL=False, EARLY=False)


def time_graph(fn, copies, calls=32) -> float:
    """Seconds per call: `calls` calls cycling over the weight copies, captured once, replayed 5 times."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(3):
            fn(copies[i % len(copies)])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fn(copies[i % len(copies)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (5 * calls)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest error relative to the largest value of the float64 product."""
    return round(((out.double() - ref).abs().max() / ref.abs().max()).item(), 5)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,6")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default="gemv.json")
    args = ap.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    res = {"gpu": torch.cuda.get_device_name(), "rows": {}}
    skinny_configs = list(itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 4)))
    row_configs = list(itertools.product((8, 16, 32), (256, 512), (4, 8), (3, 4)))
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(max(2, -(-600_000_000 // nbytes)))]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=dt)
            out = torch.empty(m, n, device=dev, dtype=dt)
            ref = x.double() @ copies[0].double().T
            row = {"torch_GBps": round(nbytes / time_graph(lambda w, x=x: torch.nn.functional.linear(x, w), copies)
                                       / 1e9),
                   "torch_err": _err(torch.nn.functional.linear(x, copies[0]), ref)}
            if m == 1:
                row["shipped_config"] = config(n, k)
                row["shipped_GBps"] = round(nbytes / time_graph(lambda w, x=x: gemv(x, w), copies) / 1e9)
                row["shipped_err"] = _err(gemv(x, copies[0]), ref)
            kind, configs = (one_row, row_configs) if m == 1 else (skinny, skinny_configs)
            best = (0.0, None)
            for cfg in configs:
                if k % cfg[1]:
                    continue
                try:
                    kind(x, copies[0], out, *cfg)
                    if _err(out, ref) > 4 * max(row["torch_err"], 1e-3):
                        row.setdefault("bad", []).append([*cfg, _err(out, ref)])
                        continue
                    gbps = nbytes / time_graph(lambda w, x=x, out=out, c=cfg, f=kind: f(x, w, out, *c), copies) / 1e9
                except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit
                    row.setdefault("failed", []).append([*cfg, str(exc)[:80]])
                    continue
                if gbps > best[0]:
                    best = (gbps, list(cfg))
            row["best_GBps"], row["best_config"] = round(best[0]), best[1]
            res["rows"][f"{name} m={m}"] = row
            print(name, m, {k: v for k, v in row.items() if k not in ("bad", "failed")}, flush=True)
        del copies
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
