"""Start-up calibration of `--speculation auto`: what a request-step of each budget costs at batch 1 on this
machine, measured before the service takes requests.

Without it a fresh policy learns every budget's rate from the first requests: plain decoding a few calls, half the
tree, then the whole tree. On the bundled tiny pair on a CPU that was the whole of a 64-token request (tau 1.97
against 3.71 once the policy had settled, `specdec generate`). Here the draft runs one throw-away request (greedy,
tokens of no meaning) through its own scheduler for each budget in turn, timed on the same path the policy times
real steps on, and seeds the policy's batch-1 times with them (`SpeculationPolicy.seed`). Plain decoding yields
one token a request-step, so it is measured outright; a speculative budget's yield is the drafts' acceptance on
real prompts, which the throw-away cannot tell, so the first requests still measure it (for chains the whole tree's
steps measure every smaller budget's yield at once: `derives_yields`). Real steps average into the seeded times
and the policy keeps re-measuring its rivals, so a time measured on a short context does not stay.

Each batch-size bucket learns on its own, so a bucket never calibrated pays the same cold start when the load first
reaches it: its plain decoding measured first (on a GPU three or four plain calls of 16 steps, 48-64 of a 128-token
request's tokens), then each speculative budget. With `batch_sizes` the draft also calibrates 2, 4, 8 ... requests
at a time (`--calibration-max-batch`; on a GPU by default up to its --max-batch-size), throw-away requests that share
one prompt, so a bucket's first real requests only measure the yield (a chain: its first two steps at 8 or more
requests). Calibration stops at `TOTAL_SECONDS`, at the first batch size whose requests the KV pools cannot take at
once (it does not wait for pages), and at any failure; what it measured stays seeded.
"""

from __future__ import annotations

import logging
import statistics
import time
import uuid
from collections.abc import Callable

from specdec.engine.adaptive import SpeculationPolicy, budget_name
from specdec.engine.requests import StepTimings
from specdec.errors import SpecdecError
from specdec.request_ids import WARMUP_PREFIX
from specdec.sampling_params import SamplingParams
from specdec.telemetry.tracing import attached, untraced_context

log = logging.getLogger(__name__)
PROMPT_LEN = 64
MAX_STEPS = 12  # scheduler steps a budget runs at most
MAX_SECONDS = 3.0  # and seconds
# at batch sizes above 1, a budget stops once this many more steps than the policy's minimum are timed, and its time
# is their median: calibrating 1-128 requests of an 8B shape through two processes on an H200 took the draft's
# start-up from 20 to 39 s with every budget running its 12 steps; and of 5 steps one stall (a shared CPU) moved
# the policy's running mean 3-7x (plain at batch 2: 10.5 ms a request-step against 3.6)
EXTRA_SAMPLES = 2
TOTAL_SECONDS = 30.0  # the most a calibration of several batch sizes takes (it ends after the batch size under way)


def batch_sizes_up_to(largest: int) -> tuple[int, ...]:
    """1, 2, 4 ... up to `largest` (and `largest` itself, the bucket it falls in); () for 0 (no calibration)."""
    sizes = [1 << i for i in range(max(0, largest).bit_length()) if 1 << i <= largest]
    return tuple(sizes + [largest] if sizes and sizes[-1] != largest else sizes)


class CalibrationStopped(SpecdecError):
    """The service is stopping (`should_stop`): calibration ends, its throw-away requests released."""


def calibrate(sched, policy: SpeculationPolicy, vocab_size: int, max_seconds: float = MAX_SECONDS,
              batch_sizes: tuple[int, ...] = (1,), total_seconds: float = TOTAL_SECONDS,
              should_stop: Callable[[], bool] = lambda: False) -> dict[int, float]:
    """Seed `policy` with each of its budgets' seconds per request-step at each of `batch_sizes` (at most the
    scheduler's max batch size), measured on `sched` (idle: before the service serves; on its engine thread), each
    budget for at most `MAX_STEPS` steps and `max_seconds`, batch sizes in order until `total_seconds` have passed.
    Returns {budget: seconds} of those measured at batch 1 (a budget whose steps ran out of time before the policy's
    rules could time it is left to the requests). A failure is logged, not raised: the policy then learns from the
    requests the rest of what it would have seeded. `should_stop` is asked between steps (a SIGTERM during
    start-up): its throw-away requests are then aborted and released on the target before it returns (left there,
    a stopped draft's 64 requests held 800 of a target's pages until its idle release 120 s later, QA)."""
    measured: dict[int, float] = {}
    t0 = time.perf_counter()
    held, timings, wait, hand_out = sched.policy, sched.timings, sched.max_queue_wait_s, sched.before_decode
    sched.timings = StepTimings()  # the service's step metrics start from its first real step
    sched.max_queue_wait_s = 0.0  # pools too small for a batch size: refused at once, not waited for
    # and the refusal comes back from `step` (the service hands admission events to streams before the decode: a
    # batch size the pools took in part was timed at the part, without a word, QA)
    sched.before_decode = None
    done: list[str] = []
    n, failed = 0, False
    try:
        with attached(untraced_context()):
            for n in [n for n in batch_sizes if 1 <= n <= sched.max_batch_size]:
                if n > 1 and time.perf_counter() - t0 > total_seconds:
                    log.info("speculation calibration stopped after %.1f s, before batch size %d", time.perf_counter()
                             - t0, n)
                    break
                at_n = {}
                for budget in policy.budgets:
                    seconds = _measure(sched, budget, vocab_size, max_seconds, n, should_stop)
                    if seconds is not None:
                        at_n[budget] = seconds
                        policy.seed(n, budget, seconds)
                if n == 1:
                    measured = at_n
                if at_n:
                    times = ", ".join(f"{budget_name(b)} {1e3 * s:.3f}" for b, s in at_n.items())
                    done.append(f"at batch {n}: {times}")
    except CalibrationStopped:
        log.info("speculation calibration stopped: the service is stopping")
        return measured
    except SpecdecError as exc:
        failed = True
        log.warning("speculation calibration stopped at %d throw-away request%s at once (%s): the policy measures "
                    "the rest on the first requests", n, "s" * (n > 1), exc)
    finally:
        sched.policy, sched.timings, sched.max_queue_wait_s, sched.before_decode = held, timings, wait, hand_out
    if done:
        log.info("speculation calibration in %.2f s, ms per request-step %s", time.perf_counter() - t0,
                 "; ".join(done))
    elif n and not failed:
        log.info("speculation calibration measured no budget in %.2f s (contexts of %d tokens leave its requests "
                 "too few steps?): the policy measures them on the first requests", time.perf_counter() - t0,
                 sched.max_context)
    return measured


def _measure(sched, budget: int, vocab_size: int, max_seconds: float, n: int = 1,
             should_stop: Callable[[], bool] = lambda: False) -> float | None:
    """Seconds per request-step of `budget` for `n` throw-away requests in one batch: a policy whose menu is that
    budget alone times the steps (its own rules leave out warm-up, ramp and ending calls)."""
    probe = SpeculationPolicy((budget,), history=[])
    sched.policy = probe
    rids = [f"{WARMUP_PREFIX}{uuid.uuid4().hex[:12]}" for _ in range(n)]
    prompt = [(7 * i + 3) % vocab_size for i in range(PROMPT_LEN)]
    room = sched.max_context - PROMPT_LEN - 1
    params = SamplingParams(max_new_tokens=max(1, min(256, room)), ignore_eos=True)
    for rid in rids:
        sched.add(rid, prompt, params)
    start = time.perf_counter()
    key = (probe.bucket(n), budget)
    enough = probe.min_samples + EXTRA_SAMPLES if n > 1 else MAX_STEPS + 1
    try:
        for _ in range(MAX_STEPS):
            if should_stop():
                raise CalibrationStopped("the service is stopping")
            _raise_failure(sched.step())
            if not any(rid in sched.running for rid in rids) and not sched.waiting \
                    or time.perf_counter() - start > max_seconds or probe.samples.get(key, 0) >= enough:
                break
    finally:
        for rid in rids:
            sched.abort(rid)
        for _ in range(16):  # (an abort waits for verifies in flight to land)
            if not sched.has_work:
                break
            sched.step()
    if probe.samples.get(key, 0) < probe.min_samples:
        return None
    if n == 1:
        return probe.seconds[key]
    steps = [entry for entry in probe.history if entry[0] == "step"]  # (not warm-up, tail or admission entries)
    steady = [seconds / (size * k) for _, size, _, _, seconds, k, *_ in steps]
    return statistics.median(steady)


def _raise_failure(events) -> None:
    for ev in events:
        if ev.error is not None:
            raise ev.error
