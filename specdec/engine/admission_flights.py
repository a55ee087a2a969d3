"""Admissions in flight: the Prefill RPCs of long prompts, sent while the running batch goes on.

A remote target that prefills a long prompt in parts (`GetModelInfo.prefill_chunk_tokens`,
`specdec.engine.prefill_parts`) runs the batch's Verify calls between the parts. A draft that waited for the
Prefill's answer inside its step would still stop every running stream for the whole prompt, so `Admission` sends
the long prompts of a group (`TargetClient.prefill_send`), admits the short ones at once, and lands each flight once
all its answers are in (`prefill_ready`, `prefill_collect`), or at once when nothing else runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from specdec.engine.run_state import RunState


@dataclass
class Flight:
    group: list[RunState]
    sent: Any  # the client's handle of the RPCs (None: every request was refused on the draft side, none sent)
    answers: list  # per request: its output or error; None until landed (the refused ones: their error at once)
    where: list[int]  # the places in `group` whose RPCs were sent, in the handle's order


class Flights:
    def __init__(self) -> None:
        self.out: list[Flight] = []
        self.last_landed = float("-inf")  # perf_counter time of the latest landing

    def __len__(self) -> int:
        """Requests in flight."""
        return sum(len(f.group) for f in self.out)

    def ids(self) -> set[str]:
        return {s.request_id for f in self.out for s in f.group}

    def send(self, target, group: list[RunState], inputs: list, answers: list, where: list[int]) -> None:
        self.out.append(Flight(group, target.prefill_send(inputs) if inputs else None, answers, where))

    @staticmethod
    def ready(target, flight: Flight) -> bool:
        return flight.sent is None or target.prefill_ready(flight.sent)

    def land(self, target, flight: Flight) -> list:
        """The flight's answers (waiting for those still out); it leaves the flights."""
        self.out.remove(flight)
        got = target.prefill_collect(flight.sent) if flight.sent is not None else []
        for i, answer in zip(flight.where, got, strict=True):
            flight.answers[i] = answer
        self.last_landed = time.perf_counter()
        return flight.answers

    def overlaps(self, since: float) -> bool:
        """Was a flight out at some time from `since` (perf_counter) to now? A step then shared the target with its
        parts (its Verify waited for one): its time is not its budget's."""
        return bool(self.out) or self.last_landed > since
