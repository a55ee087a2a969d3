"""Two-batch overlap: with draft and target on separate GPUs, the running batch is split into two micro-batches
that take turns, so that neither GPU waits for the other while the batch is large enough:

    draft GPU:   propose A | propose B | extend A, propose A | extend B, propose B | ...
    target GPU:            | verify A  | verify B           | verify A           | ...

Each `decode` sends the idle micro-batch's verify (after proposing its trees) and lands the oldest one in flight
(its events, the draft's extend over what was accepted). A verify goes out on a worker thread, so the draft's
work for one micro-batch runs while the target verifies the other. The micro-batches are balanced by tokens (the
context each request's verify attends over plus its tree), not by request count: a launch takes idle requests
until it holds about half of the running tokens, and any left over join the next launch. New requests join the
next launch; a request in flight is aborted once its verify has landed.

Plain decoding does not split: when the budget chosen for a micro-batch is plain (`--speculation auto`), what is
in flight lands and the whole batch decodes plainly in one call (the draft has nothing to overlap, and two
half-batches cost the target 37-55% more than the whole one at 128 requests on the H200).

Below `min_batch_size` running requests the scheduler steps synchronously (one verify in flight): with small
batches the target's step is short and mostly fixed cost, so halving the batch doubles the steps for little
overlap. Each micro-batch's step is timed from the previous landing, so the policy (`--speculation auto`) sees
the pipeline's real rate.

A remote target (the draft service's gRPC client) takes concurrent calls; a target that does not say so
(`concurrent_calls`, e.g. the in-process TargetEngine) is wrapped so that calls from the scheduler thread and
the verify worker take turns.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from specdec.errors import SpecdecError

if TYPE_CHECKING:
    from specdec.engine.scheduler import Event, Launch, Scheduler


class TakingTurns:
    """A target whose calls run one at a time (for a target that is not thread-safe)."""

    def __init__(self, target):
        self._target, self._lock = target, threading.Lock()

    def __getattr__(self, name):  # attributes other than the calls (max_context, batches_prefill, ...)
        return getattr(self._target, name)

    def prefill(self, inputs):
        with self._lock:
            return self._target.prefill(inputs)

    def verify(self, inputs, **kwargs):
        with self._lock:
            return self._target.verify(inputs, **kwargs)

    def release(self, request_id):
        with self._lock:
            return self._target.release(request_id)


def split_by_tokens(rids: list[str], weights: list[int], share: float) -> tuple[list[str], list[str]]:
    """(the first requests, in order, until they hold `share` of the tokens - at least one; the rest)."""
    total, taken, n = sum(weights), 0, 0
    while n < len(rids) and (n == 0 or taken < share * total - 1e-9):
        taken += weights[n]
        n += 1
    return rids[:n], rids[n:]


class TwoBatchOverlap:
    def __init__(self, min_batch_size: int = 16, device=None):
        self.min_batch_size = max(2, min_batch_size)
        self.device = torch.device(device) if device is not None else None  # the verify worker's current GPU
        self.inflight: deque[tuple[Launch, Future]] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 1  # 2 once `wrap_target` sees a target that takes concurrent calls
        self._last_land = 0.0
        self.micro_steps = 0  # landings of micro-batches (not counting synchronous steps)

    def wrap_target(self, target):
        if self.device is None:
            device = getattr(target, "device", None)
            self.device = torch.device(device) if device is not None else None
        self._workers = 2 if getattr(target, "concurrent_calls", False) else 1
        return target if self._workers == 2 else TakingTurns(target)

    def busy(self) -> set[str]:
        return {rid for launch, _ in self.inflight for rid in launch.rids}

    def decode(self, sched: Scheduler) -> list[Event]:
        busy = self.busy()
        idle = [rid for rid in sched.running if rid not in busy]  # in admission order
        big = len(sched.running) >= self.min_batch_size
        if not self.inflight:
            if not big:
                return sched.decode_now(idle)
            first, idle = split_by_tokens(idle, self._weights(sched, idle), 0.5)
            if not self._send(sched, first):
                return self._whole_plain(sched)
        if idle and big:  # the idle micro-batch goes out while the other is verified
            weights = self._weights(sched, idle)
            in_flight = sum(self._weights(sched, list(self.busy())))
            share = 0.5 * (sum(weights) + in_flight) / sum(weights)  # half of all running tokens
            rids = split_by_tokens(idle, weights, share)[0]
            if not self._send(sched, rids):
                return self._whole_plain(sched)
        return self._land_oldest(sched)

    def _whole_plain(self, sched: Scheduler) -> list[Event]:
        """A micro-batch's budget came out plain: the draft has nothing to overlap, and two half-batches cost
        the target more than the whole one (8B shape, H200: 2 x 8.5 ms vs 12.3 ms a step at 64 / 128 requests).
        Land what is in flight, then decode the whole batch plainly in one call."""
        events, chosen_at = [], len(sched.running)  # the bucket the choice was made in (see `_send`)
        while self.inflight:
            events += self._land_oldest(sched)
        if sched.running:
            events += sched.decode_now(list(sched.running), budget=0, chosen_at=chosen_at)
        self._last_land = time.perf_counter()
        return events

    @staticmethod
    def _weights(sched: Scheduler, rids: list[str]) -> list[int]:
        tree = 1 + (sched.draft.spec.num_draft_tokens if sched.draft is not None else 0)
        return [len(sched.running[r].prompt_ids) + sched.running[r].num_generated + tree for r in rids]

    def _send(self, sched: Scheduler, rids: list[str]) -> bool:
        """Launch `rids` and send their verify; False (nothing sent) when their budget is plain decoding and the
        whole batch may decode plainly (no seeded sampling in it: see `Scheduler.seeded`)."""
        # chosen (and recorded) for the whole running batch: micro-batches split by tokens vary in size around half
        # of it (61-67 of 128), which would spread one regime over two buckets that each measure their own menu
        running = len(sched.running)
        budget = sched.choose_budget(rids, running)
        if budget == 0 and not sched.seeded(list(sched.running)):
            return False
        if self._pool is None:
            init = (lambda: torch.cuda.set_device(self.device)) if self.device and self.device.type == "cuda" else None
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="specdec-verify", initializer=init)
        launch = sched.launch(rids, budget=budget, chosen_at=running)
        self.inflight.append((launch, self._pool.submit(contextvars.copy_context().run, sched.verify, launch)))
        return True

    def _land_oldest(self, sched: Scheduler) -> list[Event]:
        launch, future = self.inflight.popleft()
        try:
            outputs, error = future.result(), None
        except SpecdecError as exc:
            outputs, error = None, exc
        since = max(self._last_land, launch.started)
        events = sched.land(launch, outputs, error, since)
        self._last_land = time.perf_counter()
        self.micro_steps += 1
        return events

    def abandon(self) -> None:
        """Wait for every verify in flight and drop its result (after a broken step)."""
        while self.inflight:
            _, future = self.inflight.popleft()
            with contextlib.suppress(Exception):  # the requests are being failed anyway
                future.result()

    def close(self) -> None:
        self.abandon()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None  # a later run starts a new worker
