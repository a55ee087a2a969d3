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
"""

from __future__ import annotations

import logging
import time
import uuid

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


def calibrate(sched, policy: SpeculationPolicy, vocab_size: int, max_seconds: float = MAX_SECONDS) -> dict[int, float]:
    """Seed `policy` with each of its budgets' seconds per request-step at batch 1, measured on `sched` (idle:
    before the service serves; on its engine thread), each budget for at most `MAX_STEPS` steps and `max_seconds`.
    Returns {budget: seconds} of those measured (a budget whose steps ran out of time before the policy's rules could
    time it is left to the requests). A failure is logged, not raised: the policy then learns as before."""
    measured: dict[int, float] = {}
    t0 = time.perf_counter()
    held, timings = sched.policy, sched.timings
    sched.timings = StepTimings()  # the service's step metrics start from its first real step
    try:
        with attached(untraced_context()):
            for budget in policy.budgets:
                seconds = _measure(sched, budget, vocab_size, max_seconds)
                if seconds is not None:
                    measured[budget] = seconds
                    policy.seed(1, budget, seconds)
    except SpecdecError as exc:
        log.warning("speculation calibration stopped (%s): the policy measures its budgets on the first requests",
                    exc)
    finally:
        sched.policy, sched.timings = held, timings
    if measured:
        log.info("speculation calibration at batch 1 in %.2f s: ms per request-step %s", time.perf_counter() - t0,
                 ", ".join(f"{budget_name(b)} {1e3 * s:.2f}" for b, s in measured.items()))
    return measured


def _measure(sched, budget: int, vocab_size: int, max_seconds: float) -> float | None:
    """Seconds per request-step of `budget` for one throw-away request: a policy whose menu is that budget alone
    times the steps (its own rules leave out warm-up, ramp and ending calls)."""
    probe = SpeculationPolicy((budget,))
    sched.policy = probe
    rid = f"{WARMUP_PREFIX}{uuid.uuid4().hex[:12]}"
    prompt = [(7 * i + 3) % vocab_size for i in range(PROMPT_LEN)]
    room = sched.max_context - PROMPT_LEN - 1
    sched.add(rid, prompt, SamplingParams(max_new_tokens=max(1, min(256, room)), ignore_eos=True))
    start = time.perf_counter()
    try:
        for _ in range(MAX_STEPS):
            _raise_failure(sched.step())
            if rid not in sched.running and not sched.waiting or time.perf_counter() - start > max_seconds:
                break
    finally:
        sched.abort(rid)
        for _ in range(16):  # (an abort waits for verifies in flight to land)
            if not sched.has_work:
                break
            sched.step()
    key = (1, budget)
    return probe.seconds.get(key) if probe.samples.get(key, 0) >= probe.min_samples else None


def _raise_failure(events) -> None:
    for ev in events:
        if ev.error is not None:
            raise ev.error
