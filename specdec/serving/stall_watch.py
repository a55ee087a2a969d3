"""Health follows the engine's progress: a service whose engine thread is held far longer than any step takes says so.

A model service answers health checks on its event loop while its engine thread runs the steps. A thread held by
a hung kernel, a deadlock or a call that never returns used to leave the service reporting SERVING: the gateway
kept routing to it and its streams waited out their deadlines (QA: a target's engine thread stopped for 40 s, its
3 requests took 38.8-40.3 s). `StallWatch` looks at `EngineLoop.busy_s` once a second (more often for a short
limit); once one round of the thread's work has lasted `--engine-stall-seconds` it reports the service stalled
(`specdec.rpc.service_runner`: health UNKNOWN under every name, liveness included, new calls UNAVAILABLE saying
why; the gateway takes the part out at its next check and moves its streams on), and when the round ends it reports
the service well again. Each change is one log line, the stall an ERROR.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

DEFAULT_STALL_S = 30.0  # `--engine-stall-seconds`: a GPU step is milliseconds, a CPU prefill chunk seconds at most
LOOK_S = 1.0  # between two looks (at most; a quarter of a shorter limit)


class StallWatch:
    def __init__(self, busy_s: Callable[[], float], stall_s: float, what: str) -> None:
        """`busy_s`: seconds the engine thread has been in its current round (`EngineLoop.busy_s`); `stall_s`: how
        long a round may last before the service counts as stalled (> 0); `what`: the engine's name in messages."""
        self.busy_s, self.stall_s, self.what = busy_s, stall_s, what
        self.look_s = min(LOOK_S, stall_s / 4)
        self.stalled = False
        self.stalls = 0  # stalls seen since start
        self._longest = 0.0  # the longest round seen during the stall under way

    @property
    def reason(self) -> str:
        return (f"{self.what} has been in one step for {self._longest:.0f} s (over --engine-stall-seconds "
                f"{self.stall_s:g}): it is stalled; retry on another replica")

    async def run(self, report: Callable[[str | None], Awaitable[None]]) -> None:
        """Look until cancelled; `report(reason)` when a stall begins, `report(None)` when it ends."""
        while True:
            await asyncio.sleep(self.look_s)
            await self.look(report)

    async def look(self, report: Callable[[str | None], Awaitable[None]]) -> None:
        busy = self.busy_s()
        if busy >= self.stall_s:
            self._longest = max(self._longest, busy)
            if not self.stalled:
                self.stalled, self.stalls = True, self.stalls + 1
                log.error("%s; health reports UNKNOWN (liveness included) and new calls are refused until it "
                          "moves again", self.reason)
                await report(self.reason)
            return
        if self.stalled:
            log.warning("%s moves again after a step of at least %.1f s; health reports SERVING again", self.what,
                        self._longest)
            self.stalled, self._longest = False, 0.0
            await report(None)
