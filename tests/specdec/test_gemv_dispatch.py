"""Which projections go to the one-row kernel (`specdec.kernels.gemv`) and to the few-rows kernel
(`specdec.kernels.skinny`): 16-bit rows without a bias, of a shape each takes, where the fused kernels run;
everything else stays torch's `linear`. (The kernel's numbers are checked
in test_kernels.py under Triton's interpreter and in tests/gpu.)"""

from __future__ import annotations

import pytest
import torch

import specdec.kernels as kernels
from specdec.kernels import gemv as gemv_module
from specdec.kernels import skinny as skinny_module
from specdec.models.layers import Linear


@pytest.fixture
def spy(monkeypatch):
    """Pretend the fused kernels run on this CPU and record the one-row kernel's calls instead of running it."""
    calls = []

    def fake(name):
        def run(x, weight):
            calls.append((name, tuple(x.shape), tuple(weight.shape)))
            return torch.nn.functional.linear(x, weight)
        return run

    monkeypatch.setattr(kernels, "fused", lambda t: True)
    monkeypatch.setattr(kernels, "_gemv_on", lambda: True)
    monkeypatch.setattr(gemv_module, "gemv", fake("gemv"))
    monkeypatch.setattr(skinny_module, "skinny_linear", fake("skinny"))
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_goes_to_the_kernel(spy, dtype):
    layer = Linear(512, 48, bias=False).to(dtype)
    x = torch.randn(1, 512, dtype=dtype)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    assert spy == [("gemv", (1, 512), (48, 512))]


@pytest.mark.parametrize("rows", [2, 9, skinny_module.MAX_ROWS])
def test_a_few_rows_go_to_the_skinny_kernel(spy, rows):
    layer = Linear(512, 64, bias=False).to(torch.bfloat16)
    x = torch.randn(rows, 512, dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    assert spy == [("skinny", (rows, 512), (64, 512))]


@pytest.mark.parametrize("case", ["too many rows", "no rows", "float32", "bias", "odd width", "odd rows of w",
                                  "strided row", "strided columns", "flag off"])
def test_everything_else_stays_torch(spy, monkeypatch, case):
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    k = 300 if case == "odd width" else 512  # 300: no chunk width divides it
    layer = Linear(k, 48, bias=case == "bias").to(dtype)
    x = torch.randn(1, k, dtype=dtype)
    if case in ("too many rows", "no rows"):
        x = torch.randn(skinny_module.MAX_ROWS + 1 if case == "too many rows" else 0, k, dtype=dtype)
    if case == "odd rows of w":  # 48 weight rows: fine for one row, not a multiple of the few-rows kernel's 64
        x = torch.randn(3, k, dtype=dtype)
    if case == "strided row":
        x = torch.randn(1, 2 * k, dtype=dtype)[:, ::2]
    if case == "strided columns":
        x = torch.randn(3, 2 * k, dtype=dtype)[:, ::2]
    if case == "flag off":
        monkeypatch.setattr(kernels, "_gemv_on", lambda: False)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert spy == []


def test_config_by_shape():
    assert gemv_module.config(4096, 4096) == (16, 512, 8, 4)
    assert gemv_module.config(4096, 14336) == (16, 512, 8, 4)
    assert gemv_module.config(28672, 4096) == (16, 256, 4, 3)  # wide: 16 rows a program, 256-column chunks, 4 warps
    assert gemv_module.config(64, 256) == (16, 256, 8, 4)
    assert gemv_module.config(64, 384) == (16, 128, 8, 4)  # the tiny model's width
    assert gemv_module.config(64, 300) is None
    assert gemv_module.config(64, 0) is None and gemv_module.config(0, 256) is None  # empty: torch's linear


def test_skinny_config_by_shape():
    assert skinny_module.config(6144, 4096) == (64, 128, 4, 6)  # qkv, o: 64 weight rows a program, 6 stages
    assert skinny_module.config(4096, 4096) == (64, 128, 4, 6)
    assert skinny_module.config(4096, 14336) == (64, 256, 4, 4)  # long rows (down): 256-column chunks
    assert skinny_module.config(28672, 4096) == (128, 128, 4, 3)  # wide (gate_up, lm_head): 128 rows a program
    assert skinny_module.config(128256, 4096) == (128, 128, 4, 3)
    assert skinny_module.config(640, 384) == (64, 128, 4, 6)  # the tiny model's qkv
    assert skinny_module.config(48, 512) is None  # weight rows not a multiple of 64
    assert skinny_module.config(64, 96) is None  # no chunk width divides k
    assert skinny_module.config(64, 0) is None and skinny_module.config(0, 128) is None  # empty: torch's linear


class _CudaRows:
    """Stands in for a CUDA x (what `skinny._stages` / `applies` read of it) on this CPU."""

    is_cuda, dtype, shape = True, torch.bfloat16, (4, 4096)

    class device:
        index = 0

    def element_size(self):
        return 2

    def stride(self, dim):
        return (4096, 1)[dim]


@pytest.mark.parametrize("gpu_shared_kb, want_stages", [(227, (6, 4, 3)), (163, (4, 2, 2)), (99, (2, 2, 2))])
def test_skinny_stages_fit_the_gpus_shared_memory(monkeypatch, gpu_shared_kb, want_stages):
    """The H200's 227 KB a block keeps the measured stages; an A100's 163 or an L4's 99 get fewer, never under 2."""
    monkeypatch.setattr(skinny_module, "shared_bytes", lambda index: gpu_shared_kb * 1024)
    configs = [skinny_module.config(n, k) for n, k in ((4096, 4096), (4096, 14336), (28672, 4096))]
    got = tuple(skinny_module._stages(_CudaRows(), 16, block_n, block_k, stages)
                for block_n, block_k, _, stages in configs)
    assert got == want_stages


def test_skinny_not_taken_where_two_stages_do_not_fit(monkeypatch):
    """An 80 KB pair of stages fits an L4's 99 KB a block, not a 64 KB one."""
    w = torch.empty(4096, 14336, dtype=torch.bfloat16)  # 2 stages of 64 x 256 weight + 16 x 256 x: 80 KB
    x = _CudaRows()
    x.shape, x.stride = (4, 14336), lambda dim: (14336, 1)[dim]
    monkeypatch.setattr(skinny_module, "capable", lambda index: True)
    monkeypatch.setattr(skinny_module, "shared_bytes", lambda index: 99 * 1024)
    assert skinny_module.applies(x, w)
    monkeypatch.setattr(skinny_module, "shared_bytes", lambda index: 64 * 1024)
    assert not skinny_module.applies(x, w)


def test_skinny_not_taken_on_gpus_before_ampere(monkeypatch):
    w = torch.empty(4096, 4096, dtype=torch.bfloat16)
    monkeypatch.setattr(skinny_module, "shared_bytes", lambda index: 227 * 1024)
    monkeypatch.setattr(skinny_module.torch.cuda, "get_device_capability", lambda index: (7, 5))
    skinny_module.capable.cache_clear()
    try:
        assert not skinny_module.applies(_CudaRows(), w)
        monkeypatch.setattr(skinny_module.torch.cuda, "get_device_capability", lambda index: (9, 0))
        skinny_module.capable.cache_clear()
        assert skinny_module.applies(_CudaRows(), w)
    finally:
        skinny_module.capable.cache_clear()
