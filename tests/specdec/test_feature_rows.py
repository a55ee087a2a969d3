"""The target's features at committed rows (`TargetEngine._features` / `_batch_features_of`): rows that run with
no gap are read as one slice, others through an index; both give the same values, in new memory (the forward's
output may be a captured graph's buffer, which the next replay overwrites)."""

from __future__ import annotations

import pytest
import torch

from specdec.engine.target_engine import TargetEngine


class _Req:
    def __init__(self, layers=()):
        self.feature_layers = layers


@pytest.mark.parametrize("layers", [(), (1, 3)])
def test_slice_and_index_read_the_same_rows_into_new_memory(layers):
    hidden = torch.randn(9, 4)
    aux = {1: torch.randn(9, 4), 3: torch.randn(9, 4)}
    by_slice = TargetEngine._features(_Req(layers), hidden, aux, slice(2, 6))
    by_index = TargetEngine._features(_Req(layers), hidden, aux, torch.arange(2, 6))
    assert torch.equal(by_slice, by_index) and by_slice.shape == (4, 4 * max(1, len(layers)))
    hidden.zero_()
    for t in aux.values():
        t.zero_()
    assert torch.equal(by_slice, by_index) and by_slice.abs().sum() > 0  # neither is a view


@pytest.mark.parametrize("rows, committed", [([9], [[0, 1, 2, 3]]),  # a chain at batch 1: one slice
                                             ([1, 1, 1], [[0], [0], [0]]),  # a plain step of 3 requests
                                             ([3, 3], [[0, 1], [0, 2]]),  # gaps: an index
                                             ([5], [[0, 2, 4]])])
def test_batch_features_are_each_requests_committed_rows(rows, committed):
    hidden = torch.randn(sum(rows), 4)
    got = TargetEngine._batch_features_of(TargetEngine, [_Req()] * len(rows), rows, committed, hidden, {})
    start = 0
    for n, c, f in zip(rows, committed, got, strict=True):
        assert torch.equal(f, hidden[[start + r for r in c]])
        start += n
