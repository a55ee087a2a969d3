"""Host-to-device copies (`specdec.host_copy`): the values and dtypes arrive unchanged whichever way they travel.
The non-blocking GPU path is checked on a GPU (`tests/gpu`: engine steps make one host sync each)."""

from __future__ import annotations

import pytest
import torch

from specdec import host_copy
from specdec.host_copy import copy_in, to_device


@pytest.mark.parametrize("blocking", [False, True])
def test_values_and_dtypes_arrive_unchanged(blocking, monkeypatch):
    monkeypatch.setattr(host_copy, "SYNC_COPIES", blocking)
    assert to_device([3, 1, 2], "cpu").tolist() == [3, 1, 2]
    assert to_device([3, 1, 2], torch.device("cpu"), torch.int32).dtype == torch.int32
    src = torch.arange(6).reshape(2, 3)
    assert torch.equal(to_device(src, "cpu"), src)
    dst = torch.zeros(5, dtype=torch.int64)
    copy_in(dst[1:4], [7, 8, 9])
    assert dst.tolist() == [0, 7, 8, 9, 0]
    copy_in(dst[:2], torch.tensor([4, 5]))
    assert dst.tolist() == [4, 5, 8, 9, 0]


@pytest.mark.parametrize("dtype", [None, torch.int32, torch.int64])
def test_long_int_lists_convert_like_torch(dtype):
    """`host_tensor` reads long int lists through `array.array`: same values and dtype as `torch.as_tensor`, and
    what that path cannot hold (floats, bools, ints too large) still converts (or fails) as torch does."""
    values = [(i * 7919) % 100003 for i in range(500)]
    expected = torch.as_tensor(values, dtype=dtype)
    got = host_copy.host_tensor(values, dtype)
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    for odd in ([0.5] * 40, [True] * 40, [1] * 39 + [1.5], [2**40] * 40):
        if dtype == torch.int32 and odd[-1] == 2**40:
            with pytest.raises(RuntimeError, match="overflow"):
                host_copy.host_tensor(odd, dtype)
            continue
        assert torch.equal(host_copy.host_tensor(odd, dtype), torch.as_tensor(odd, dtype=dtype))
