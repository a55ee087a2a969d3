"""A lock handed over in the order it was asked for.

Two engine threads share one target engine when the draft runs its target in its process: the draft's scheduler
(prefill, verify) and the in-process `TargetService`'s engine loop (plain `Generate` steps, other drafts' calls).
That loop takes the lock again right after releasing it, and a `threading.Lock` goes to whichever thread runs
first: under four busy `Generate` clients the draft's calls waited 0.5-1.2 s for it (QA: its requests then lost
their place for KV pages and timed out). This one serves its waiters first come, first served.
"""

from __future__ import annotations

import threading


class FairLock:
    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._issued = 0  # tickets handed out
        self._serving = 0  # the ticket that holds the lock (or may take it)
        self.holder: int | None = None  # the thread that holds it (`threading.get_ident`), None while free

    def acquire(self) -> None:
        with self._cond:
            ticket = self._issued
            self._issued += 1
            while self._serving != ticket:
                self._cond.wait()
            self.holder = threading.get_ident()

    def release(self) -> None:
        with self._cond:
            self.holder = None
            self._serving += 1
            self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
