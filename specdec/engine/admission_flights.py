"""Admissions in flight: long prompts prefilled in parts while the running batch goes on.

A target that prefills a long prompt in parts (`specdec.engine.prefill_parts`) can run other work between two
parts. `Admission` sends each long prompt as a flight of its own, admits the short ones at once, and starts each
flight's request once its prefill is done:
- a remote target (`GetModelInfo.prefill_chunk_tokens`; `TargetClient.prefill_send`) runs the batch's Verify calls
  between the parts itself; the draft lands the flight once its RPC is answered (`prefill_ready`,
  `prefill_collect`), or waits for it when nothing else runs;
- a target in this process (a colocated pair, the target's own `Generate`: `begin_prefill`, `prefill_part`) runs
  one part per scheduler step (`advance`), so a running stream waits for one part a step, not for the prompt; on
  the target's engine thread, the service's calls (other drafts' Verify RPCs) run between the steps too.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from specdec.engine.run_state import RunState
from specdec.errors import Cancelled, SpecdecError


def in_process_parts(target) -> bool:
    """Does `target` run a prompt's parts on the calling thread, one call each (`PrefillParts`)?"""
    return callable(getattr(target, "prefill_part", None)) and not callable(getattr(target, "prefill_send", None))


@dataclass
class Flight:
    state: RunState
    sent: Any = None  # a remote flight: the client's handle of the RPC
    answer: Any = None  # its output or its SpecdecError, once known (refused on the draft side: at once)
    parts: bool = False  # an in-process flight: its prompt's parts run a step at a time (`Flights.advance`)


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
            self.out.append(Flight(state, answer=inp))
        elif not in_process_parts(target):
            self.out.append(Flight(state, sent=target.prefill_send([inp])))
        else:
            try:
                target.begin_prefill(inp)  # its pages, in its turn: refused, its error is its answer
            except SpecdecError as exc:
                self.out.append(Flight(state, answer=exc))
            else:
                self.out.append(Flight(state, parts=True))

    def advance(self, target, aborted: set[str]) -> None:
        """Run one part of the first in-process flight still prefilling (in their order: the first request of the
        queue starts first). A flight whose request was aborted stops: it is released, and answers Cancelled. A part
        that fails fails its request alone (the target released it); its error is the answer."""
        for flight in [f for f in self.out if f.parts and f.answer is None]:
            if flight.state.request_id in aborted:
                self._drop(target, flight)
                flight.answer = Cancelled("the request was aborted during its admission")
                continue
            try:
                flight.answer = target.prefill_part(flight.state.request_id)
            except Exception as exc:  # noqa: BLE001 - a bad prompt, a failed forward: this request fails alone
                flight.answer = exc if isinstance(exc, SpecdecError) else SpecdecError(f"prefill failed: {exc!r}")
            return

    @staticmethod
    def ready(target, flight: Flight) -> bool:
        if flight.answer is not None:
            return True
        return not flight.parts and target.prefill_ready(flight.sent)

    def land(self, target, flight: Flight):
        """The flight's answer, its output or its error (a remote one's is waited for if still out; an in-process
        one lands once `ready`); it leaves the flights."""
        self.out.remove(flight)
        self.last_landed = time.perf_counter()
        if flight.answer is None:
            flight.answer = target.prefill_collect(flight.sent)[0]
        return flight.answer

    def close(self, target) -> list[tuple[RunState, Any]]:
        """The service stops: prompts still in flight are cancelled (an in-process one released); -> each flight's
        request and its answer, what its target may have admitted (`Admission._undo_answers`)."""
        closed = []
        for flight in list(self.out):
            self.out.remove(flight)
            if flight.answer is None and flight.parts:
                self._drop(target, flight)
                flight.answer = Cancelled("the service is stopping")
            elif flight.answer is None:
                target.cancel_prefill(flight.state.request_id)
                flight.answer = target.prefill_collect(flight.sent)[0]
            closed.append((flight.state, flight.answer))
        return closed

    @staticmethod
    def _drop(target, flight: Flight) -> None:
        with contextlib.suppress(SpecdecError):
            target.release(flight.state.request_id)

    def overlaps(self, since: float) -> bool:
        """Was a flight out at some time from `since` (perf_counter) to now? A step then shared the target with its
        parts (its Verify waited for one): its time is not its budget's."""
        return bool(self.out) or self.last_landed > since
