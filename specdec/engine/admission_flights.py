"""Admissions in flight: the Prefill RPCs of long prompts, sent while the running batch goes on.

A remote target that prefills a long prompt in parts (`GetModelInfo.prefill_chunk_tokens`,
`specdec.engine.prefill_parts`) runs the batch's Verify calls between the parts. A draft that waited for the
Prefill's answer inside its step would still stop every running stream for the whole prompt, so `Admission` sends
each long prompt of a group as a flight of its own (`TargetClient.prefill_send`), admits the short ones at once, and
lands each flight once answered (`prefill_ready`, `prefill_collect`), or at once when nothing else runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from specdec.engine.run_state import RunState
from specdec.errors import SpecdecError


@dataclass
class Flight:
    state: RunState
    sent: Any  # the client's handle of the RPC (None: refused on the draft side, nothing sent)
    refused: SpecdecError | None = None  # why it was not sent


class Flights:
    def __init__(self) -> None:
        self.out: list[Flight] = []
        self.last_landed = float("-inf")  # perf_counter time of the latest landing

    def __len__(self) -> int:
        """Requests in flight."""
        return len(self.out)

    def ids(self) -> set[str]:
        return {f.state.request_id for f in self.out}

    def send(self, target, state: RunState, inp) -> None:
        """`inp`: its PrefillInput, or the SpecdecError that refused it on the draft side."""
        if isinstance(inp, SpecdecError):
            self.out.append(Flight(state, None, inp))
        else:
            self.out.append(Flight(state, target.prefill_send([inp])))

    @staticmethod
    def ready(target, flight: Flight) -> bool:
        return flight.sent is None or target.prefill_ready(flight.sent)

    def land(self, target, flight: Flight):
        """The flight's answer, its output or its error (waiting for it if still out); it leaves the flights."""
        self.out.remove(flight)
        self.last_landed = time.perf_counter()
        return flight.refused if flight.sent is None else target.prefill_collect(flight.sent)[0]

    def overlaps(self, since: float) -> bool:
        """Was a flight out at some time from `since` (perf_counter) to now? A step then shared the target with its
        parts (its Verify waited for one): its time is not its budget's."""
        return bool(self.out) or self.last_landed > since
