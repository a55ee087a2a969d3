"""Round-robin among equally loaded pairs, per kind of request: speculative and plain requests alternating one at a
time over two pairs each spread over both (QA: with one turn counter for both kinds, every speculative request
went to one pair and every plain one to the other)."""

from __future__ import annotations

from gateway.config import PairAddress
from gateway.router import Pair, Router


def _pair(i: int) -> Pair:
    return Pair(i, PairAddress(f"d{i}:1", f"t{i}:1"), target=None, draft=object(), target_up=True, draft_up=True)


def test_alternating_kinds_each_spread_over_the_pairs():
    router = Router([_pair(0), _pair(1)])
    served: dict[bool, list[int]] = {True: [], False: []}
    for i in range(12):
        speculative = i % 2 == 0
        lease = router.acquire(speculative)
        served[speculative].append(lease.pair.index)
        router.release(lease)
    assert sorted(served[True]) == [0, 0, 0, 1, 1, 1] and sorted(served[False]) == [0, 0, 0, 1, 1, 1]
