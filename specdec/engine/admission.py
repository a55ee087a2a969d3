"""Admission: waiting requests (FIFO) join the running batch while it has room. A group of them (at most
MAX_PREFILL_TOKENS prompt tokens) is prefilled by the target in one call (in-process) or one Prefill RPC each, all at
once (a remote target, whose answers are taken one by one); the draft then extends over their prompts. A request
refused for lack of KV pages waits, with every request behind it, up to `max_queue_wait_s`, retried every
QUEUE_POLL_S; a request refused otherwise fails alone. The prompts the target prefills in parts fly on their own and
land later (`specdec.engine.admission_flights`): a remote target's while a batch runs, an in-process target's
always, a part per step.

While a batch runs, one admission prefills at most one part's worth (`prefill_chunk_tokens`) of short prompts a
step: a burst of short prompts, prefilled together, stopped every running stream for up to MAX_PREFILL_TOKENS of
prefill, as one long prompt did before it was prefilled in parts.

`Admission` is a part of `Scheduler` (a mixin over its queue, batch, target and draft), kept in its own file.
"""

from __future__ import annotations

import contextlib
import time

from specdec.engine.admission_flights import in_process_parts
from specdec.engine.plain_steps import PLAIN_STEPS
from specdec.engine.requests import ABORT, RUNNING, PrefillInput
from specdec.engine.run_state import Event, RunState
from specdec.errors import Cancelled, OutOfPages, SpecdecError
from specdec.telemetry.tracing import add_event, attached, untraced_context

QUEUE_POLL_S = 0.01  # how often a request waiting for KV pages retries its admission
MAX_PREFILL_TOKENS = 16384  # prompt tokens admitted in one target prefill call
GATHER_GAP_S = 0.001  # an idle scheduler gathering a burst admits once no request came for this long
# The fewest prompt tokens whose features a prompt brings when a feature budget is set (`prompt_feature_rows`):
# the tiny pair (EAGLE-1, 16 dev prompts of 256 tokens, chain of 5, 128 new tokens) committed 4.23 tokens a step
# with whole prompts, 4.19 with the last 128, 4.09 with 64, 3.93 with 32 and 3.66 with the last one only.
MIN_PROMPT_FEATURE_ROWS = 64
_BLOCKED = object()  # admission result: the KV pools are full, the request waits
PROMPT_EXTEND = "draft.extend_prompt"  # span name of the draft's extend over admitted prompts


def _prefill_trace(state: RunState):
    """The trace a request's Prefill joins: its own, but not while it waits for KV pages (asked again every 10 ms: a
    30 s wait put ~4,600 RESOURCE_EXHAUSTED Prefill spans in its trace, QA). Its first refusal is traced, and its
    admission after the wait is one `specdec.waited_for_pages` event on its span (`_start`)."""
    return state.trace_context if state.blocked_since is None else untraced_context()


class Admission:
    def _expire_blocked(self) -> list[Event]:
        """Requests that waited max_queue_wait_s for KV pages fail with OutOfPages (RESOURCE_EXHAUSTED)."""
        now, events = time.monotonic(), []
        for state in [s for s in self.waiting if s.blocked_since is not None]:
            waited = now - state.blocked_since
            if waited >= self.max_queue_wait_s:
                err = OutOfPages(f"KV pool full: waited {waited:.1f} s for pages (limit {self.max_queue_wait_s:g} s)")
                self._end_waiting(state, events, err)
        if not self.waiting:
            self._retry_at = 0.0
        return events

    def _end_waiting(self, state: RunState, events: list[Event], error: SpecdecError | None = None) -> None:
        """A waiting request ends (ABORT, with `error` if it failed) before its admission."""
        self.waiting.remove(state)
        self._give_up_place(state)
        events.append(Event(state.request_id, [], ABORT, error=error))

    def _give_up_place(self, state: RunState) -> None:
        """A waiting request leaves the target's page queue now (aborted, or its wait ran out): its place there would
        otherwise hold up the requests behind it until it lapses (`page_queue.LAPSE_S`)."""
        if state.blocked_since is not None and self.max_queue_wait_s > 0:
            with contextlib.suppress(SpecdecError):
                self.target.release(state.request_id)

    def _block_waiting(self) -> None:
        now = time.monotonic()
        for state in self.waiting:
            if state.blocked_since is None:
                state.blocked_since = now
        self._retry_at = now + QUEUE_POLL_S
        hold = getattr(self.target, "hold_places", None)  # an engine in this process (a remote one: each Prefill)
        if hold is not None and self.max_queue_wait_s > 0:  # the whole queue keeps its places in the target's turn
            hold([PrefillInput(s.request_id, s.prompt_ids, s.sampling) for s in self.waiting])

    def _admit(self) -> list[Event]:
        """Admit waiting requests (FIFO) while the batch has room: prefill groups of them in one target call
        (at most MAX_PREFILL_TOKENS prompt tokens each; one group of at most a part's tokens while a batch runs),
        then extend the draft over their prompts. The prompts the target prefills in parts are left in flight and
        land once done (`specdec.engine.admission_flights`); the others are admitted at once."""
        events, extend = [], []
        if self._land_flights(events, extend) or extend:  # (newcomers wait for the next step: the batch goes first)
            return self._extended(events, extend)
        if self._retry_at and time.monotonic() < self._retry_at:
            return events
        self._retry_at = 0.0
        if self.gather_s and not self.running and self.waiting:
            # idle: a burst (128 streams opened at once) lands over milliseconds; admitting its first few alone
            # would size their prompts' features and first calls for a batch of a few
            # (the queue is in arrival order: its last request is the latest to arrive)
            until = min(self.waiting[-1].arrived + GATHER_GAP_S, self.waiting[0].arrived + self.gather_s)
            if time.monotonic() < until:
                self._retry_at = until
                return events
        # the batch these requests will decode in, as far as the queue tells (128 arriving at once: 128)
        self._joining = min(self.max_batch_size, len(self.running) + len(self.flights) + len(self.waiting))
        self._prompt_window = self._window(min(len(self.waiting), self.max_batch_size - len(self.running)))
        step_tokens = self._step_tokens()
        while self.waiting and len(self.running) + len(self.flights) < self.max_batch_size:
            self._drop_left(events)
            group = self._send_long(self._next_group(step_tokens or MAX_PREFILL_TOKENS))
            if not group:
                continue
            self.admitting = group  # (the gauges count them as waiting)
            try:
                blocked = self._admit_group(group, self._prefill_each(group), events, extend)
            finally:
                self.admitting = []
            if blocked or step_tokens:  # (a batch runs: the rest waits for the next step)
                break
        return self._extended(events, extend)

    def _drop_left(self, events: list[Event]) -> None:
        """Waiting requests whose clients have left end now (ABORT), before a group is taken: the groups of one
        admission are prefilled one after another, each a blocking call, and a client that left during one had its
        abort queued behind this whole admission, so the next group's Prefill ran for nobody (QA: 74 of 80 long
        prompts prefilled after their clients had left, the short requests behind them waiting 37 s)."""
        for state in [state for state in self.waiting if state.request_id in self.left]:
            self._end_waiting(state, events)

    @property
    def _chunk(self) -> int:
        """The target's part (`prefill_chunk_tokens`; 0: it prefills every prompt in one forward)."""
        return getattr(self.target, "prefill_chunk_tokens", 0)

    def _step_tokens(self) -> int:
        """While a batch runs, the most prompt tokens prefilled in this step's one group (the target's part, where
        it prefills in parts); 0: no such bound (groups of up to MAX_PREFILL_TOKENS, as many as fit)."""
        return min(self._chunk, MAX_PREFILL_TOKENS) if self.running and self._chunk > 0 else 0

    def _flies(self, state: RunState) -> bool:
        """Is the request's prompt prefilled in flight, in parts (`_send_long`)?"""
        if not 0 < self._chunk < len(state.prompt_ids):
            return False
        if in_process_parts(self.target):
            return True
        return bool(self.running) and callable(getattr(self.target, "prefill_send", None))

    def _extended(self, events: list[Event], extend: list) -> list[Event]:
        if extend:
            self._extend(extend, self._step_trace([self.running[rid] for rid, _, _ in extend]), PROMPT_EXTEND)
        return events

    def _admit_group(self, group: list[RunState], answers: list | None, events: list[Event], extend: list) -> bool:
        """Start the group's requests from their prefill `answers` (None: prefill them now); -> whether the queue
        is blocked (a request must wait for KV pages: it and those behind it are back at the queue's head)."""
        outs, blocked = self._prefill_together(group) if answers is None else None, False
        if outs is None:  # a single request, or the group failed: one by one, so a failure stays its own
            outs = []
            for i, state in enumerate(group):
                out = self._prefill_one(state, events, answers[i] if answers else None)
                if out is _BLOCKED:  # waits (FIFO) until pages free up or the limit passes
                    if answers:
                        self._undo_answers(group[i + 1 :], answers[i + 1 :])
                    self.waiting.extendleft(reversed(group[i:]))
                    self._block_waiting()
                    blocked = True
                    break
                outs.append(out)
        for state, out in zip(group, outs, strict=False):  # (those before a blocked one start)
            if out is not None:
                self._start(state, out, events, extend)
        return blocked

    @property
    def num_admitting(self) -> int:
        """Requests taken off the queue whose prefill is under way or in flight (the gauges count them as waiting)."""
        return len(self.admitting) + len(self.flights)

    def _send_long(self, group: list[RunState]) -> list[RunState]:
        """Send the group's prompts that the target prefills in parts, each left in flight on its own; -> the
        others, admitted now. A remote target (`prefill_send`) runs the batch's Verify calls between a prompt's parts
        (only while a batch runs: otherwise the draft waits for them), an in-process one runs a part per step
        (`Flights.advance`)."""
        now = []
        for state in group:
            if not self._flies(state):
                now.append(state)
                continue
            answers: list = [None]  # a flight each, each starting once it is in (QA: four sent as one flight all
            inputs, _ = self._prefill_inputs([state], answers)  # started with the longest, 3 s in)
            self.flights.send(self.target, state, inputs[0] if inputs else answers[0])
        return now

    def _land_flights(self, events: list[Event], extend: list) -> bool:
        """Run a part of the in-process flights, then start the request of every flight that is answered (every
        remote flight, waiting, when nothing runs); -> whether the queue is blocked. A request aborted while in
        flight ends now, before it would run a step."""
        self.flights.advance(self.target, self._aborts)
        for flight in list(self.flights.out):
            if (self.running or flight.parts) and not self.flights.ready(self.target, flight):
                continue
            answer, rid = self.flights.land(self.target, flight), flight.state.request_id
            if rid in self._aborts and not isinstance(answer, SpecdecError):
                with contextlib.suppress(SpecdecError):
                    self.target.release(rid)
                answer = Cancelled("the request was aborted during its admission")
            if self._admit_group([flight.state], [answer], events, extend):
                return True
        return False

    def _close_flights(self) -> None:
        """The service stops: prompts still in flight are cancelled, and what their target admitted released."""
        for state, answer in self.flights.close(self.target):
            self._undo_answers([state], [answer])

    def _next_group(self, limit: int) -> list[RunState]:
        """The queue's next requests whose prompts prefilled now (not in flight) hold at most `limit` tokens (the
        first one always goes)."""
        group, tokens = [], 0
        while self.waiting and len(self.running) + len(self.flights) + len(group) < self.max_batch_size:
            n = 0 if self._flies(self.waiting[0]) else len(self.waiting[0].prompt_ids)
            if group and tokens + n > limit:
                break
            group.append(self.waiting.popleft())
            tokens += n
        return group

    def _prefill_input(self, state: RunState) -> PrefillInput:
        if self.draft is not None:
            self.draft.add(state.request_id, len(state.prompt_ids) + state.sampling.max_new_tokens,
                           len(state.prompt_ids))
        return PrefillInput(state.request_id, state.prompt_ids, state.sampling, self.feature_layers,
                            self.draft is not None, trace_context=_prefill_trace(state),
                            feature_rows=self._prompt_feature_rows(state), queue_for_pages=self.max_queue_wait_s > 0)

    def _prompt_feature_rows(self, state: RunState) -> int:
        """How many of the prompt's last tokens bring their features (0: all of them). 1 where the policy decodes
        plainly at the size of the batch the request joins: the draft then skips the prompt but its last token, as
        it skips plain stretches (`Scheduler._hold`). Through the services a prompt's features crossed the wire to
        a draft that would not speculate on them (8B shape: 8 KB a token, 200 MB for 128 prompts of 200 tokens)
        and the draft extended over all of them; the price is a draft without the prompt's context if speculation
        resumes for it. Otherwise the prompt's share of the admission's feature budget (`_window`), where it
        is shorter than the prompt. A seeded sampled request always brings its whole prompt: its draws depend on
        its trees (`seeded`), which must not depend on the load it arrived at."""
        if self.draft is None or self.seeded_state(state):
            return 0
        if self.policy is not None and self.policy.plain_leads(max(1, self._joining)):
            return 1
        window = self._prompt_window
        return window if 0 < window < len(state.prompt_ids) else 0

    def _window(self, wave: int) -> int:
        """Feature rows per prompt when `wave` prompts are admitted together under `prompt_feature_rows` (0: no
        budget, whole prompts), at least MIN_PROMPT_FEATURE_ROWS. The features of whole prompts were what made
        admission under speculation slow at large batch: 128 prompts of ~256 tokens of an 8B shape are 268 MB
        (1.13-1.35 s of admission against 0.80-0.84 s without them, 2 x H200, eleventh pass), while the draft's
        acceptance gains little from tokens far back (see MIN_PROMPT_FEATURE_ROWS)."""
        if not self.prompt_feature_rows or wave < 1:
            return 0
        return max(MIN_PROMPT_FEATURE_ROWS, self.prompt_feature_rows // wave)

    def _prefill_together(self, group: list[RunState]):
        """Outputs for the whole group from one target call, or None (one request, or any failure: nothing of
        the group is left admitted). The call joins the first request's trace."""
        if len(group) < 2 or not getattr(self.target, "batches_prefill", False):
            return None
        inputs = []
        try:
            for state in group:
                inputs.append(self._prefill_input(state))
            with attached(_prefill_trace(group[0])):
                return self.target.prefill(inputs)
        except SpecdecError:
            # the target admitted none of the group (its prefill is all or nothing): nothing to release there. An
            # id in the group may be held on the target by another caller (a draft, when clients reuse an id
            # at once): releasing it would end that request (its next Verify NOT_FOUND)
            for state in group:
                self._drop_draft(state.request_id)
            return None

    def _prefill_each(self, group: list[RunState]) -> list | None:
        """For a target that answers each request of a group alone (`prefill_each`: a remote one, one Prefill RPC
        per request, all in flight at once, each in its request's trace): per request its output or its error.
        None for other targets."""
        prefill_each = getattr(self.target, "prefill_each", None)
        if prefill_each is None:
            return None
        answers: list = [None] * len(group)
        inputs, where = self._prefill_inputs(group, answers)
        for i, answer in zip(where, prefill_each(inputs) if inputs else [], strict=True):
            answers[i] = answer
        return answers

    def _prefill_inputs(self, group: list[RunState], answers: list) -> tuple[list[PrefillInput], list[int]]:
        """The group's Prefill inputs and their places in it; a request refused on the draft side (its KV pool, a
        duplicate id) gets its error in `answers` and no input."""
        inputs, where = [], []
        for i, state in enumerate(group):
            try:
                inputs.append(self._prefill_input(state))
                where.append(i)
            except SpecdecError as exc:
                answers[i] = exc
        return inputs, where

    def _undo_answers(self, states: list[RunState], answers: list) -> None:
        """Requests behind one that must wait for pages wait too (FIFO): undo what their answers admitted."""
        for state, answer in zip(states, answers, strict=True):
            self._drop_draft(state.request_id)
            if not isinstance(answer, SpecdecError):
                with contextlib.suppress(SpecdecError):
                    self.target.release(state.request_id)

    def _prefill_one(self, state: RunState, events: list[Event], answer=None):
        """The request's prefill output (`answer`: what `_prefill_each` got for it; None: prefill it now); None
        if it failed (an error event is added); _BLOCKED if the pools are full and it may wait."""
        rid = state.request_id
        try:
            if isinstance(answer, SpecdecError):
                raise answer
            if answer is not None:
                return answer
            inp = self._prefill_input(state)
            with attached(_prefill_trace(state)):  # the Prefill RPC joins the request's trace
                return self.target.prefill([inp])[0]
        except SpecdecError as exc:
            self._drop_draft(rid)
            if isinstance(exc, OutOfPages) and self.max_queue_wait_s > 0:
                return _BLOCKED
            # aborted during its admission: it ends as an abort before or after it does (FINISH_REASON_ABORT), not
            # with an error (a CANCELLED status, which the gateway reads as the draft failing and falls back on)
            aborted = isinstance(exc, Cancelled) and rid in self._aborts
            events.append(Event(rid, [], ABORT, error=None if aborted else exc))
            return None

    def _drop_draft(self, rid: str) -> None:
        """Undo a failed admission's draft state (never a running request's, should the id repeat)."""
        if self.draft is not None and rid in self.draft.requests and rid not in self.running:
            self.draft.release(rid)

    def _start(self, state: RunState, out, events: list[Event], extend: list) -> None:
        rid = state.request_id
        state.num_generated = 1
        if state.blocked_since is not None:  # its wait, on its trace in one event (its Prefills while waiting: none)
            waited = round(time.monotonic() - state.blocked_since, 3)
            add_event(state.trace_context, "specdec.waited_for_pages", {"seconds": waited})
        events.append(Event(rid, [out.first_token], out.finish_reason))
        if out.finish_reason != RUNNING:
            if self.draft is not None:
                self.draft.release(rid)
            return
        self.running[rid] = state
        self._plain_ramp = PLAIN_STEPS  # more may be arriving: plain calls start short again
        if self.draft is not None:
            tokens = state.prompt_ids[1:] + [out.first_token]  # token i pairs with the feature at prompt token i
            rows = out.features.shape[0]
            self.draft.skip(rid, len(tokens) - rows)  # the prompt's earlier tokens, if only the last rows came
            extend.append((rid, tokens[len(tokens) - rows :], out.features))
