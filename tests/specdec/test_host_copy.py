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
