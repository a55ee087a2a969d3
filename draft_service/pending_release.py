"""Requests the target may still hold that the draft could not release when they ended.

A request that fails because its target is away (stalled, cut off, restarting: NotReady) ends on the draft at once,
but the target, if it lived, keeps its KV pages and its id: nothing released them, and its idle sweep
(`--request-idle-seconds`, 120 s; counted again from the end of a stall) was the only way out. QA and the stall
test saw a target that came back hold a stalled stream's pages for those two minutes. The draft now keeps those ids
and releases them as soon as its target answers again (`TargetClient.release_pending`, the draft engine's chore);
an id a new request takes is released first (`take`, before its Prefill). Release is idempotent on the target, so a
target restarted meanwhile just ignores them. At most `MAX_IDS` are kept (the oldest dropped: the idle sweep still
frees those).
"""

from __future__ import annotations

import threading

MAX_IDS = 65536


class PendingReleases:
    def __init__(self, max_ids: int = MAX_IDS) -> None:
        self.max_ids = max_ids
        self._ids: dict[str, None] = {}  # oldest first
        self._lock = threading.Lock()  # the engine thread and the overlap's verify worker add

    def add(self, request_ids) -> None:
        with self._lock:
            for rid in request_ids:
                self._ids.pop(rid, None)
                self._ids[rid] = None
            while len(self._ids) > self.max_ids:
                del self._ids[next(iter(self._ids))]

    def take(self, request_ids=None) -> list[str]:
        """Remove and return the pending ids among `request_ids` (None: all of them)."""
        with self._lock:
            if request_ids is None:
                taken, self._ids = list(self._ids), {}
                return taken
            taken = [rid for rid in request_ids if rid in self._ids]
            for rid in taken:
                del self._ids[rid]
            return taken

    def __len__(self) -> int:
        return len(self._ids)
