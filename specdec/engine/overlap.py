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

Below `min_batch_size` running requests (0: always) the scheduler steps synchronously (one verify in flight):
with small batches the target's step is short and mostly fixed cost, so halving the batch doubles the steps for
little overlap.

Pipelined plain calls: while the whole batch decodes plainly, `plain_in_flight` (2) plain calls of it are in
flight, the next sent before the previous one's reply, so the target runs one after the other without waiting a
round trip and the draft's bookkeeping between them (through the services a plain call otherwise paid ~2-4 ms
that the target's own `Generate` never pays: tiny pair, batch 1, 16 steps a call, 0.73x of `Generate`). A call
names each running request that the calls before it leave running as far as the draft can tell (not aborted,
below its token limit); one that an earlier call finished at a stop token gets an empty result with its finish
reason (`TargetEngine.finished`). Order matters: the second call continues where the first ends, so calls go out
from the scheduler thread in order (`Scheduler.send`, a target with `verify_start`), or through one worker for a
target without it. When the policy's choice turns speculative, what is in flight lands first. Independent of
the micro-batches: the draft service keeps one of these for every run (`min_batch_size` 0 without
`--two-batch-overlap`).

Each micro-batch's step (and each pipelined plain call) is timed from the previous landing, so the policy
(`--speculation auto`) sees the pipeline's real rate.

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
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from specdec.engine.device import resolve_device
from specdec.errors import OutOfOrder, SpecdecError

if TYPE_CHECKING:
    from specdec.engine.scheduler import Event, Launch, Scheduler


class TakingTurns:
    """A target whose calls run one at a time (for a target that is not thread-safe); `lock`: one shared with
    whatever else drives the same target (default: a lock of its own)."""

    def __init__(self, target, lock: AbstractContextManager | None = None):
        self._target, self.lock = target, lock if lock is not None else threading.Lock()

    def __getattr__(self, name):  # attributes other than the calls (max_context, batches_prefill, ...)
        return getattr(self._target, name)

    def prefill(self, inputs):
        with self.lock:
            return self._target.prefill(inputs)

    def verify(self, inputs, **kwargs):
        with self.lock:
            return self._target.verify(inputs, **kwargs)

    def release(self, request_id):
        with self.lock:
            return self._target.release(request_id)

    def begin_prefill(self, inp):
        with self.lock:
            return self._target.begin_prefill(inp)

    def prefill_part(self, request_id):
        with self.lock:
            return self._target.prefill_part(request_id)


def split_by_tokens(rids: list[str], weights: list[int], share: float) -> tuple[list[str], list[str]]:
    """(the first requests, in order, until they hold `share` of the tokens - at least one; the rest)."""
    total, taken, n = sum(weights), 0, 0
    while n < len(rids) and (n == 0 or taken < share * total - 1e-9):
        taken += weights[n]
        n += 1
    return rids[:n], rids[n:]


class TwoBatchOverlap:
    def __init__(self, min_batch_size: int = 16, device=None, plain_in_flight: int = 2):
        self.min_batch_size = max(2, min_batch_size) if min_batch_size else 0  # 0: no micro-batches
        self.plain_in_flight = max(1, plain_in_flight)  # whole-batch plain calls in flight (1: one at a time)
        self._plain = False  # what is in flight is pipelined plain calls
        self._ordered = False  # the target takes calls started in order (`verify_start`)
        self.device = resolve_device(device) if device is not None else None  # the verify worker's current GPU
        self.inflight: deque[tuple[Launch, Future]] = deque()
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 1  # 2 once `wrap_target` sees a target that takes concurrent calls
        self._last_land = 0.0
        self.micro_steps = 0  # landings of micro-batches (not counting synchronous steps)

    def wrap_target(self, target):
        if self.device is None:
            device = getattr(target, "device", None)
            self.device = resolve_device(device) if device is not None else None
        self._workers = 2 if getattr(target, "concurrent_calls", False) else 1
        self._ordered = callable(getattr(target, "verify_start", None))
        if self._workers == 2 and not self._ordered:
            self.plain_in_flight = 1  # two workers may send a pipeline's calls out of order
        return target if self._workers == 2 else TakingTurns(target)

    def busy(self, sched: Scheduler) -> set[str]:
        """The running requests a call in flight names (not a new request under the id of one that a failed call
        ended while another of its calls was still out: that call names the old one)."""
        return {rid for launch, _ in self.inflight for i, rid in enumerate(launch.rids) if sched.is_current(launch, i)}

    def decode(self, sched: Scheduler) -> list[Event]:
        if self._plain and self.inflight:
            return self._continue_plain(sched)
        self._plain = False
        return self._take_turns(sched)

    def _take_turns(self, sched: Scheduler, budget: int | None = None) -> list[Event]:
        """Send the idle micro-batch (or step synchronously below `min_batch_size`), land the oldest in flight.
        `budget`: already chosen for the next launch."""
        busy = self.busy(sched)
        idle = [rid for rid in sched.running if rid not in busy]  # in admission order
        big = bool(self.min_batch_size) and len(sched.running) >= self.min_batch_size
        if not self.inflight:
            if not big:
                budget = sched.choose_budget(idle) if budget is None else budget
                if budget == 0 and self.plain_in_flight > 1:
                    return self._start_plain(sched, len(idle))
                return sched.decode_now(idle, budget=budget)
            first, idle = split_by_tokens(idle, self._weights(sched, idle), 0.5)
            if not self._send(sched, first, budget):
                return self._whole_plain(sched)
        if idle and big:  # the idle micro-batch goes out while the other is verified
            weights = self._weights(sched, idle)
            in_flight = sum(self._weights(sched, list(self.busy(sched))))
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
        if sched.running and self.plain_in_flight > 1:
            return events + self._start_plain(sched, chosen_at)
        if sched.running:
            events += sched.decode_now(list(sched.running), budget=0, chosen_at=chosen_at)
        self._last_land = time.perf_counter()
        return events

    def _start_plain(self, sched: Scheduler, chosen_at: int) -> list[Event]:
        """The first call of a plain pipeline; the next `decode` sends the second, then lands this one."""
        self._plain = True
        self._send_plain(sched, chosen_at)
        return [] if self.inflight else sched.decode_now(list(sched.running), budget=0, chosen_at=chosen_at)

    def _continue_plain(self, sched: Scheduler) -> list[Event]:
        """Plain calls are in flight: send the next one while the policy still chooses plain decoding, then land
        the oldest; once it chooses to speculate, land them all and take that step at once."""
        running = len(sched.running)
        budget = sched.choose_budget(list(sched.running), running) if sched.running else 0
        if budget == 0:
            if len(self.inflight) < self.plain_in_flight:
                self._send_plain(sched, running)
            return self._land_oldest(sched)
        events = []
        while self.inflight:
            events += self._land_oldest(sched)
        self._plain = False
        return events + self._take_turns(sched, budget) if sched.running else events

    def _send_plain(self, sched: Scheduler, chosen_at: int) -> None:
        """A plain call of every running request that the calls in flight leave running as far as the scheduler
        can tell: not being aborted, short of its token limit (one at its limit would get an empty result)."""
        pending: dict[str, int] = {}  # tokens the calls in flight commit at most, per request
        for launch, _ in self.inflight:
            for i, rid in enumerate(launch.rids):
                if sched.is_current(launch, i):  # (a stale call of a failed batch commits nothing for a new request)
                    pending[rid] = pending.get(rid, 0) + launch.plain_steps
        rids = [rid for rid, state in sched.running.items() if rid not in sched.aborting and
                pending.get(rid, 0) < state.room(sched.max_context)]
        if rids:  # recorded at the call's own size once it is smaller than the batch the choice was made for:
            # at a run's end the last requests ran alone (9 of 128, 0.7 ms a request-step against 0.06) and,
            # recorded at 128, pulled plain's rate there from ~15.5k to 9.1k tok/s (one H200, tau 5), so `auto`
            # followed the whole chain at 11.5k
            self._submit(sched, sched.launch(rids, budget=0, chosen_at=min(chosen_at, len(rids)), ahead=pending))

    @staticmethod
    def _weights(sched: Scheduler, rids: list[str]) -> list[int]:
        tree = 1 + (sched.draft.spec.num_draft_tokens if sched.draft is not None else 0)
        return [len(sched.running[r].prompt_ids) + sched.running[r].num_generated + tree for r in rids]

    def _send(self, sched: Scheduler, rids: list[str], budget: int | None = None) -> bool:
        """Launch `rids` and send their verify; False (nothing sent) when their budget is plain decoding and the
        whole batch may decode plainly (no seeded sampling in it: see `Scheduler.seeded`)."""
        # chosen (and recorded) for the whole running batch: micro-batches split by tokens vary in size around half
        # of it (61-67 of 128), which would spread one regime over two buckets that each measure their own menu
        running = len(sched.running)
        budget = sched.choose_budget(rids, running) if budget is None else budget
        if budget == 0 and not sched.seeded(list(sched.running)):
            return False
        self._submit(sched, sched.launch(rids, budget=budget, chosen_at=running, micro=True), ordered=False)
        return True

    def _submit(self, sched: Scheduler, launch: Launch, ordered: bool = True) -> None:
        """Send a launch's verify: on a worker thread, or (`ordered`: a pipeline's calls must reach the target in
        the order sent) from this thread when the target can start calls without waiting."""
        if ordered and self._ordered:
            self.inflight.append((launch, sched.send(launch)))
            return
        if self._pool is None:
            init = (lambda: torch.cuda.set_device(self.device)) if self.device and self.device.type == "cuda" else None
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="specdec-verify", initializer=init)
        self.inflight.append((launch, self._pool.submit(contextvars.copy_context().run, sched.verify, launch)))

    def _land_oldest(self, sched: Scheduler) -> list[Event]:
        launch, future = self.inflight.popleft()
        try:
            outputs, error = future.result(), None
        except OutOfOrder:
            launch, outputs, error = self._again(sched, launch)
            if launch is None:  # its requests ended meanwhile
                return []
        except SpecdecError as exc:
            outputs, error = None, exc
        since = max(self._last_land, launch.started)
        events = sched.land(launch, outputs, error, since)
        self._last_land = time.perf_counter()
        self.micro_steps += 1
        return events

    @staticmethod
    def _again(sched: Scheduler, launch: Launch) -> tuple[Launch | None, list | None, SpecdecError | None]:
        """A pipelined call that reached the target before the call sent ahead of it was refused there, having
        committed nothing (two unary calls in flight reach a gRPC server's handlers in no guaranteed order; once
        seen as a text whose 4-token chunks came back swapped). Every call before it has landed now: send it again,
        for the requests still running (None: none is). -> (the launch sent, its outputs or its error)"""
        running = [i for i in range(len(launch.rids)) if sched.is_current(launch, i)]
        if not running:
            return None, None, None
        launch = launch.only(running)
        try:
            return launch, sched.verify(launch), None
        except SpecdecError as exc:
            return launch, None, exc

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
