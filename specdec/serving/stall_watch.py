"""Health follows the engine's progress: a service whose engine thread is held far longer than any step takes says so.

A model service answers health checks on its event loop while its engine thread runs the steps. A thread held by
a hung kernel, a deadlock or a call that never returns used to leave the service reporting SERVING: the gateway
kept routing to it and its streams waited out their deadlines (QA: a target's engine thread stopped for 40 s, its
3 requests took 38.8-40.3 s). `StallWatch` looks at `EngineLoop.busy_s` once a second (more often for a short
limit); once one round of the thread's work has lasted `--engine-stall-seconds` it reports the service stalled
(`specdec.rpc.service_runner`: health UNKNOWN under every name, liveness included, new calls UNAVAILABLE saying
why; the gateway takes the part out at its next check and moves its streams on), and when the round ends it reports
the service well again. Each change is one log line, the stall an ERROR.

A look that comes late by a good part of the limit means this whole process did not run meanwhile (SIGSTOP, a
frozen VM or container): the engine's round then counts the pause, which is no stall of the engine, so that look
is skipped and the next one judges (QA: a target stopped for 40 s and continued logged the ERROR and answered
UNKNOWN for a second, its step done long before).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

DEFAULT_STALL_S = 30.0  # `--engine-stall-seconds`: a GPU step is milliseconds, a CPU prefill chunk seconds at most
MIN_STALL_S = 1.0  # the shortest limit the flag takes (0 aside): a look a second could not tell a shorter one
SHORT_STALL_S = 10.0  # a limit under this is warned about at start
LOOK_S = 1.0  # between two looks (at most; a quarter of a shorter limit)
PAUSED_S = 2.0  # a look this late (at most; half a shorter limit) follows a pause of the whole process


class StallWatch:
    def __init__(self, busy_s: Callable[[], float], stall_s: float, what: str,
                 which: Callable[[], str] | None = None) -> None:
        """`busy_s`: seconds the engine thread has been in its current round (`EngineLoop.busy_s`); `stall_s`: how
        long a round may last before the service counts as stalled (> 0); `what`: the engine's name in messages;
        `which`: where a process has two engine threads (a draft with its target in-process), the name of the one
        held longer, read when a stall begins (QA: the in-process target's frozen thread was named the draft's)."""
        self.busy_s, self.stall_s, self.what, self.which = busy_s, stall_s, what, which
        self.look_s = min(LOOK_S, stall_s / 4)
        if stall_s < SHORT_STALL_S:
            # QA, 2 s on a 2-core CPU: a 1,500-token prefill outlasted it, the streams moved to the other pair, whose
            # step then outlasted it too, and back: every request failed
            log.warning("--engine-stall-seconds %g is short: a step that outlasts it (a long prompt's prefill on a "
                        "slow device) takes %s's service out and moves its streams, prefills and all, to the next "
                        "service, which may stall in turn; keep it well above the longest step "
                        "specdec:engine_busy_seconds shows (default %g)", stall_s, what, DEFAULT_STALL_S)
        self.stalled = False
        self.stalls = 0  # stalls seen since start
        self._longest = 0.0  # the longest round seen during the stall under way
        self.clock = time.monotonic
        self.pauses = 0  # looks skipped because the process had been paused

    @property
    def reason(self) -> str:
        """Why calls are refused (still true as the stall goes on: it names the limit, not a time that ages)."""
        return (f"{self.what} has been in one step for over {self.stall_s:g} s (--engine-stall-seconds): it is "
                f"stalled; retry on another replica")

    async def run(self, report: Callable[[str | None], Awaitable[None]]) -> None:
        """Look until cancelled; `report(reason)` when a stall begins, `report(None)` when it ends."""
        while True:
            before = self.clock()
            await asyncio.sleep(self.look_s)
            late = self.clock() - before - self.look_s
            if late >= min(PAUSED_S, self.stall_s / 2):
                self.pauses += 1
                log.info("%s's stall watch looked %.1f s late: this process was paused; the next look judges",
                         self.what, late)
                continue
            await self.look(report)

    async def look(self, report: Callable[[str | None], Awaitable[None]]) -> None:
        busy = self.busy_s()
        if busy >= self.stall_s:
            self._longest = max(self._longest, busy)
            if not self.stalled:
                self.stalled, self.stalls = True, self.stalls + 1
                if self.which is not None:
                    self.what = self.which()
                log.error("%s (%.1f s so far); health reports UNKNOWN under every name (a liveness probe's too) "
                          "and new calls are refused until it moves again", self.reason, busy)
                await report(self.reason)
            return
        if self.stalled:
            log.warning("%s moves again after a step of at least %.1f s; health reports SERVING again", self.what,
                        self._longest)
            self.stalled, self._longest = False, 0.0
            await report(None)
