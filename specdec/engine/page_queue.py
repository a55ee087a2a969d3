"""Whose turn it is for a target engine's KV pages when several callers wait for them.

A target's pool is shared by callers that each queue their own requests: its own `Generate` scheduler, every
draft that verifies on it (a remote one through Prefill RPCs, or the draft in the same process), each retrying a
request refused for lack of pages every few milliseconds. Without a common order, whichever caller retried first
after pages came back took them: a steady stream of plain `Generate` calls kept the pages while a draft's
admissions waited out their limit (QA: 0-1 of 4 draft requests admitted against 4 busy `Generate` clients).

The engine keeps one queue of the requests it refused for lack of pages, in the order of their first refusal. A
request is admitted only when no earlier one still waits; one behind them is refused (and joins the queue) even
where it would fit. A caller that stops asking (its client left, its draft died) loses its place after LAPSE_S
without asking again, so a request nobody retries holds up the others for that long at most.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable

LAPSE_S = 0.5  # a waiting request not asked for again within this long is dropped from the queue


class PageQueue:
    def __init__(self, lapse_s: float = LAPSE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.lapse_s = lapse_s
        self._clock = clock
        self._seen: dict[str, float] = {}  # request id -> when its caller last asked; insertion order = turn order

    def __contains__(self, rid: str) -> bool:
        return rid in self._seen

    def __len__(self) -> int:
        """Requests waiting now, lapsed places not counted (read from any thread: it changes nothing)."""
        now = self._clock()
        return sum(not self._lapsed(seen, now) for seen in list(self._seen.values()))

    def count_with(self, others: Iterable[str]) -> int:
        """Distinct requests among those waiting now and `others` (a caller's own queue, whose blocked requests
        also hold places here): the target's `num_requests_waiting` (read from any thread: it changes nothing)."""
        now = self._clock()
        return len({rid for rid, seen in list(self._seen.items()) if not self._lapsed(seen, now)} | set(others))

    def ahead(self, rid: str, besides: Collection[str] = ()) -> int:
        """How many waiting requests come before `rid` (all of them if it does not wait yet), not counting those
        in `besides` (admitted already)."""
        self._drop_lapsed()
        count = 0
        for waiting in self._seen:
            if waiting == rid:
                break
            count += waiting not in besides
        return count

    def wait(self, rid: str) -> None:
        """`rid` was refused for lack of pages: it joins the end of the queue, or keeps its place there."""
        self._seen[rid] = self._clock()

    def leave(self, rids: Iterable[str]) -> None:
        for rid in rids:
            self._seen.pop(rid, None)

    def _lapsed(self, seen: float, now: float) -> bool:
        return now - seen > self.lapse_s

    def _drop_lapsed(self) -> None:
        now = self._clock()
        for gone in [r for r, seen in self._seen.items() if self._lapsed(seen, now)]:
            del self._seen[gone]
