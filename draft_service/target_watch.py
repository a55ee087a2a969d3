"""A draft's readiness follows its remote target's.

A draft cannot serve a request without its target, yet it reported SERVING while the target was away: its requests
failed UNAVAILABLE after their Prefill, and a probe on the draft alone said all was well. Worse, a target restarted
as another model (a rolling update with another `--model`) was never checked again: every request paid a Prefill the
draft then threw away (`malformed features: ... expected last dimension 384`), the gateway took the draft out of
rotation, its health check put it back 1.5 s later, and so on for every request (QA).

So the draft asks its target's GetModelInfo every `WATCH_S` (every `RECHECK_S` after an unanswered one, and at once
when one of its requests' calls did not reach the target: `nudge`; before, a killed target's draft reported SERVING
for 2-4 s, and the gateway sent it requests that failed and fell back, QA). Unanswered `MISSES_DOWN` times in a
row, or answered by a target that does not fit the draft (the start-up checks: `draft_service.app.target_mismatch`),
the draft reports NOT_SERVING under its service's name and the overall "" (the gateway then serves the pair's
requests on its target plainly, or on another pair); a target that answers and fits makes it SERVING again. The
process's `liveness` name stays SERVING: a Kubernetes liveness probe does not restart the draft for its target's
absence. Each change is logged once, and while the target does not answer each new reason once (at most
`MAX_REASONS`): a target back with TLS where the draft speaks plaintext closes the handshake, which the draft then
words as such (QA: the log kept the first reason, `Connection refused`, for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from specdec.errors import SpecdecError

log = logging.getLogger(__name__)

WATCH_S = 2.0  # between two GetModelInfo calls
MISSES_DOWN = 2  # unanswered calls in a row before the draft reports NOT_SERVING (one can be a hiccup)
ANSWER_S = 5.0  # how long a call waits for its answer
RECHECK_S = 0.25  # between two calls once one went unanswered or a request's call missed the target (and at least)
_UNANSWERED = "unanswered"
MAX_REASONS = 8  # new reasons for one outage that are logged (the rest are not)


class TargetWatch:
    def __init__(self, client, problem: Callable[[object], str | None], interval_s: float = WATCH_S,
                 misses_down: int = MISSES_DOWN, answer_s: float = ANSWER_S) -> None:
        """`client`: the draft's TargetClient (`model_info(timeout_s)`); `problem`: why a GetModelInfo answer does
        not fit the draft, or None."""
        self.client, self.problem = client, problem
        self.interval_s, self.misses_down, self.answer_s = interval_s, misses_down, answer_s
        self.down: str | None = None  # why the draft reports NOT_SERVING (None: it is ready)
        self._missed = 0
        self._reasons: set[str] = set()  # why the target did not answer, as logged during this outage
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None

    @property
    def misfit(self) -> str | None:
        """Why the target that answers does not fit this draft (another model, a smaller context, ...), or None
        (it fits, or it does not answer: then a request's own calls to it fail and fail over)."""
        return None if self.down in (None, _UNANSWERED) else self.down

    def nudge(self) -> None:
        """A request's call did not reach the target (any thread): look now rather than at the next interval."""
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # (the loop closed: the service is stopping)
                loop.call_soon_threadsafe(wake.set)

    async def run(self, set_ready: Callable[[bool], Awaitable[None]]) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        while True:
            await asyncio.sleep(min(RECHECK_S, self.interval_s))  # one look per RECHECK_S at most, nudged or not
            if not self._missed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, self.interval_s - RECHECK_S))
            self._wake.clear()
            await self.check(set_ready)

    def _look(self):
        self.client.renew_channel()
        info = self.client.model_info(self.answer_s)
        probe_lane = getattr(self.client, "probe_lane", None)  # (a client without a verify lane has none)
        if probe_lane is not None:
            probe_lane(self.answer_s)
        return info

    async def check(self, set_ready: Callable[[bool], Awaitable[None]]) -> None:
        """One look at the target (on a new channel when the TLS files were renewed); reports a change of readiness
        through `set_ready`."""
        try:
            info = await asyncio.to_thread(self._look)
        except SpecdecError as exc:
            self._missed += 1
            if self._missed < self.misses_down:
                return
            key, message = _UNANSWERED, f"the target at {self.client.addr} does not answer ({exc})"
        else:
            self._missed = 0
            message = self.problem(info)
            key = message
            if message is None:
                if self.down is not None:
                    if self.down == _UNANSWERED and hasattr(self.client, "target_back"):
                        self.client.target_back()  # a lane refused while it was away is not a lane cut off
                    self.down = None
                    log.info("the target at %s answers again (%s): this draft is SERVING", self.client.addr,
                             info.model)
                    await set_ready(True)
                return
        if key == self.down:
            if key == _UNANSWERED and message not in self._reasons and len(self._reasons) < MAX_REASONS:
                self._reasons.add(message)
                log.info("%s (still NOT_SERVING)", message)
            return
        was_ready, self.down = self.down is None, key
        self._reasons = {message}
        if key == _UNANSWERED:
            self.client.abandon_calls(message)  # calls still waiting for it end now: their requests fail over
        log.warning("%s: this draft reports NOT_SERVING until its target answers and fits it", message)
        if was_ready:
            await set_ready(False)
