"""Which projections go to the one-row kernel (`specdec.kernels.gemv`): one 16-bit row without a bias, of a shape
it takes, where the fused kernels run; everything else stays torch's `linear`. (The kernel's numbers are checked
in test_kernels.py under Triton's interpreter and in tests/gpu.)"""

from __future__ import annotations

import pytest
import torch

import specdec.kernels as kernels
from specdec.kernels import gemv as gemv_module
from specdec.models.layers import Linear


@pytest.fixture
def spy(monkeypatch):
    """Pretend the fused kernels run on this CPU and record the one-row kernel's calls instead of running it."""
    calls = []

    def fake_gemv(x, weight):
        calls.append((tuple(x.shape), tuple(weight.shape)))
        return torch.nn.functional.linear(x, weight)

    monkeypatch.setattr(kernels, "fused", lambda t: True)
    monkeypatch.setattr(kernels, "_gemv_on", lambda: True)
    monkeypatch.setattr(gemv_module, "gemv", fake_gemv)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_row_goes_to_the_kernel(spy, dtype):
    layer = Linear(512, 48, bias=False).to(dtype)
    x = torch.randn(1, 512, dtype=dtype)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
    assert spy == [((1, 512), (48, 512))]


@pytest.mark.parametrize("case", ["two rows", "float32", "bias", "odd width", "strided row", "flag off"])
def test_everything_else_stays_torch(spy, monkeypatch, case):
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    k = 300 if case == "odd width" else 512  # 300: no chunk width divides it
    layer = Linear(k, 48, bias=case == "bias").to(dtype)
    x = torch.randn(2 if case == "two rows" else 1, k, dtype=dtype)
    if case == "strided row":
        x = torch.randn(1, 2 * k, dtype=dtype)[:, ::2]
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


def test_cpu_tensors_never_reach_the_kernel():
    """Without the interpreter a CPU tensor is never `fused`, whatever its dtype."""
    layer = Linear(512, 48, bias=False).to(torch.bfloat16)
    x = torch.randn(1, 512, dtype=torch.bfloat16)
    assert not kernels.fused(x)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))
