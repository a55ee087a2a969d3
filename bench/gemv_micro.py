"""The 8B shape's projections at a few rows (batch-1 decode, a chain verify): torch's `linear` (cuBLAS) against
Triton kernels, each timed inside a CUDA graph over weight copies larger than the L2 cache, as GB/s of weights read.
One row: the shipped `specdec.kernels.gemv` at its own config (`shipped_GBps`); more rows: the shipped
`specdec.kernels.skinny` (rows padded to 16, or 32 past 16: `skinny_linear` takes up to 32, `kernels.linear` sends
it up to `MAX_ROWS`); `--sweep` also times each kernel's configs. Issue 6: the GEMMs were ~88% of copy bandwidth
in a batch-1 forward; a row-major tensor-core kernel (x the MMA's wide side) lost to cuBLAS on three of five shapes
at 6 rows (session 14), the transposed one won on four and tied on the fifth at 7 and 9 (session 19).

    python bench/gemv_micro.py [--rows 1,7,9] [--shapes qkv,o] [--sweep] [--out gemv.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.kernels.gemv import _gemv_kernel, config, gemv  # noqa: E402
from specdec.kernels.skinny import _skinny_kernel, skinny_linear  # noqa: E402
from specdec.kernels.skinny import config as skinny_config  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096),  # the 8B target; then the EAGLE-3 head's own (fc, midlayer qkv, lm_head)
          "e3_fc": (4096, 12288), "e3_qkv": (6144, 8192), "e3_lm_head": (32000, 4096)}


def skinny_t(x, w, out, block_n, block_k, warps, stages):
    """The shipped few-rows kernel (`specdec.kernels.skinny`) at a given config."""
    m, k = x.shape
    _skinny_kernel[(w.shape[0] // block_n,)](x, w, out, m, k, x.stride(0), w.stride(0), out.stride(0),
                                            BLOCK_M=16 if m <= 16 else 32, BLOCK_N=block_n, BLOCK_K=block_k,
                                            num_warps=warps, num_stages=stages, PDL=False, EARLY=False)


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
    ap.add_argument("--sweep", action="store_true", help="also each kernel's configs (the best one reported)")
    args = ap.parse_args(argv)
    dev, dt = "cuda", torch.bfloat16
    res = {"gpu": torch.cuda.get_device_name(), "rows": {}}
    skinny_configs = list(itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4, 6)))
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
            shipped, shipped_config = (gemv, config) if m == 1 else (skinny_linear, skinny_config)
            row["shipped_config"] = shipped_config(n, k)
            row["shipped_GBps"] = round(nbytes / time_graph(lambda w, x=x, f=shipped: f(x, w), copies) / 1e9)
            row["shipped_err"] = _err(shipped(x, copies[0]), ref)
            if args.sweep:
                kind, configs = (one_row, row_configs) if m == 1 else (skinny_t, skinny_configs)
                _sweep(row, kind, configs, x, copies, out, ref, nbytes, n, k)
            res["rows"][f"{name} m={m}"] = row
            print(name, m, {k: v for k, v in row.items() if k not in ("bad", "failed")}, flush=True)
        del copies
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


def _sweep(row, kind, configs, x, copies, out, ref, nbytes, n, k):
    """The best config of `kind` into `row`; wrong or failing configs listed."""
    best = (0.0, None)
    for cfg in configs:
        if k % cfg[1] or n % cfg[0]:
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


if __name__ == "__main__":
    sys.exit(main())
