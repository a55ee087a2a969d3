"""`FairLock` goes to its waiters in the order they asked, also against a thread that takes it again at once (the
in-process TargetService's engine loop against the draft's calls, `draft_service/colocated.py`)."""

from __future__ import annotations

import threading
import time

from specdec.engine.fair_lock import FairLock


def _until(cond, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_waiters_take_the_lock_in_the_order_they_asked():
    lock, order = FairLock(), []
    lock.acquire()
    threads = []
    for name in "bcde":
        t = threading.Thread(target=lambda name=name: (lock.acquire(), order.append(name), lock.release()))
        t.start()
        threads.append(t)
        _until(lambda n=len(threads): lock._issued == n + 1)  # this one waits before the next one starts
    lock.release()
    for t in threads:
        t.join(5)
    assert order == list("bcde")


def test_a_thread_taking_it_again_at_once_lets_the_waiter_in_first():
    lock, turns, stop = FairLock(), [], threading.Event()

    def busy():  # an engine loop: holds the lock for a step, releases it, takes it again at once
        while not stop.is_set():
            with lock:
                turns.append("loop")
                end = time.perf_counter() + 0.002  # a step's work, the GIL held
                while time.perf_counter() < end:
                    pass

    loop = threading.Thread(target=busy)
    loop.start()
    _until(lambda: len(turns) > 3)
    waits = []
    for _ in range(20):
        t0 = time.monotonic()
        with lock:
            waits.append(time.monotonic() - t0)
            turns.append("call")
    stop.set()
    loop.join(5)
    assert max(waits) < 0.5  # one step of the loop at most, give or take the scheduler
    calls = [i for i, who in enumerate(turns) if who == "call"]
    assert all(b - a <= 3 for a, b in zip(calls, calls[1:], strict=False))  # taking turns, not starved
