"""The speculative loop over a running batch (continuous batching), independent of transport.

One `step()`: admit waiting requests (target prefill, draft extend over the prompt), then for the running batch
propose trees (draft), verify them in one call (target), and extend the draft over what was accepted. With no
draft the same loop is plain decoding (empty trees). `target` is anything with the TargetEngine methods
`prefill`, `verify` and `release`: the engine itself in-process, or the draft service's gRPC client.

Tracing (OpenTelemetry API only; off and free unless the service set it up): a request added with its trace
context gets its target prefill inside that context. Each step decides once, via `step_spans`
(`SPECDEC_STEP_SPAN_RATIO`), whether it records `draft.propose`, `draft.verify` (the Verify RPC's spans become
its children) and `draft.extend`. A step covers a whole batch, so its spans are parented to the first request
of the batch whose trace is sampled and linked to every other request's span (`batch_parent`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from opentelemetry import trace

from specdec.engine.adaptive import FULL, SpeculationPolicy
from specdec.engine.admission import PROMPT_EXTEND, Admission
from specdec.engine.admission_flights import Flights
from specdec.engine.draft_engine import DraftEngine
from specdec.engine.overlap import TwoBatchOverlap
from specdec.engine.plain_steps import PLAIN_STEPS
from specdec.engine.requests import ABORT, RUNNING, StepTimings, VerifyInput
from specdec.engine.run_state import Event, Launch, RunState
from specdec.errors import InvalidInput, NotReady, OutOfOrder, SpecdecError, UnknownRequest
from specdec.sampling_params import SamplingParams
from specdec.telemetry.tracing import StepSpanSampler, batch_parent
from specdec.tree import TokenTree, TreeCap, max_depth

__all__ = ["Event", "Launch", "RunState", "Scheduler"]

log = logging.getLogger(__name__)
# a verify refused with these names one of its requests (the engine's checks run before anything is committed)
ONE_REQUESTS = (UnknownRequest, OutOfOrder, InvalidInput)
_EMPTY = TokenTree((), ())  # a plain decode step: verify of the root alone
# Feature rows a plain call asks for per request (`VerifyRequest.feature_rows`): its last token's. The draft follows
# only that token of a plain stretch and skips the rest: through the services a plain call's features were most of
# its reply (8B shape, 128 requests, 4 steps a call: 4 MB, +10 ms on a 47 ms call, 2 x H200), and catching up on
# every plain token cost the draft up to 50 us a token there; both were counted against plain decoding, so `auto`
# speculated where plain decoding was faster. The price: the draft's context misses the stretch, lowering
# acceptance when speculation resumes (tiny pair, EAGLE-1, 96 skipped tokens: 4.63 instead of 5.06 tokens a step,
# 32: 4.84 instead of 4.98; `bench/plain_stretch_skip.py`).
PLAIN_FEATURE_ROWS = 1
ENDING_SHARE = 8  # a call in which at least 1 in this many of its requests finished is not sampled by the policy
# An admission taking longer than this (it prefilled requests) is taken out of the step intervals around it
# (`land`): the policy once read a whole-chain micro-step of 17 requests as 195 ms, an admission of 31 requests
# included, against 10-20 ms steady (8B shape, tau 5, 2 x H200), and followed plain decoding at 0.9x.
ADMISSION_NOTICED_S = 0.0005


class Scheduler(Admission):
    # how long a request arriving during a plain call should wait at most to join, as far as the call's length
    # decides it (the first calls after an admission: `_plain_steps_per_call`)
    admit_window_s = 0.025

    def __init__(self, target, draft: DraftEngine | None, max_context: int, max_batch_size: int = 64,
                 feature_layers: tuple[int, ...] = (), max_queue_wait_s: float = 0.0,
                 step_spans: StepSpanSampler | None = None, policy: SpeculationPolicy | None = None,
                 timings: StepTimings | None = None, overlap: TwoBatchOverlap | None = None,
                 plain_steps: int = PLAIN_STEPS, gather_s: float = 0.0, prompt_feature_rows: int = 0):
        self.target, self.draft = target, draft
        # tokens a plain step commits per request in one target call (one host sync; one RPC through the draft)
        self.plain_steps = plain_steps
        # verifies in flight: two micro-batches in turn (draft and target on separate GPUs) and pipelined plain
        # calls (`TwoBatchOverlap`); None: one synchronous step at a time
        self.overlap = overlap
        if overlap is not None:
            self.target = overlap.wrap_target(target)
        self.policy = policy  # None: always speculate when there is a draft
        if policy is not None:
            policy.plain_call_steps = plain_steps  # its re-measurement intervals count target steps
        if policy is not None and draft is not None and draft.spec.topk == 1:
            policy.derives_yields = True  # chains: a step tells the smaller budgets' yields (`_derived`)
        if policy is not None and draft is not None:
            policy.max_step_tokens = draft.spec.num_steps + 1  # a path of the tree and the target's token
        self.step_spans = step_spans or StepSpanSampler(0.0)  # default: no step spans
        # a request refused for lack of KV pages waits (FIFO) up to this long, then fails OutOfPages; 0: at once
        self.max_queue_wait_s = max_queue_wait_s
        self._retry_at = 0.0  # while the pools are full: when the queue head may try again
        self.max_context, self.max_batch_size = max_context, max_batch_size
        self.feature_layers = feature_layers
        self.waiting: deque[RunState] = deque()
        self.admitting: list[RunState] = []  # taken off `waiting`, their prefill under way (`Admission._admit`)
        self.flights = Flights()  # long prompts prefilled in parts meanwhile (`Admission._send_long`)
        self.running: dict[str, RunState] = {}
        # the requests the last `step` ended, with their counters: one admitted and finished within a step is in
        # `running` neither before it nor after (accept-eval read 0 target steps for them: QA)
        self.ended: dict[str, RunState] = {}
        self._aborts: set[str] = set()
        # ids whose clients have left, as the engine loop hears of it (any thread adds, before the abort call that
        # follows reaches this thread): an admission of several groups takes none of them (`Admission._drop_left`)
        self.left: set[str] = set()
        self.timings = timings if timings is not None else StepTimings()
        self._last_budget: int | None = None  # the budget of the latest launch (a switch settles the draft first)
        self._joining = 0  # the batch size admission expects its requests to join (`Admission._admit`)
        self._plain_ramp = PLAIN_STEPS  # the most steps of the next whole-batch plain call (`_plain_steps_per_call`)
        self._plain_step_s: float | None = None  # seconds per step of the latest plain call, its round trip included
        # an idle scheduler waits up to this long for the rest of a burst before admitting (`Admission._admit`)
        self.gather_s = gather_s
        self._admissions: deque[tuple[float, float]] = deque(maxlen=16)  # (start, seconds) of recent admissions
        # the most prompt tokens' features one admission asks of the target (the draft's --prompt-feature-mb over a
        # token's feature bytes): a wave of prompts shares it, each bringing its last tokens' features only
        # (`Admission._window`); 0: whole prompts
        self.prompt_feature_rows = prompt_feature_rows
        self._prompt_window = 0  # feature rows per prompt of the admission under way (0: whole prompts)
        # called with a step's events so far (aborts, expiries, admissions with their first tokens) before its
        # decode, which then returns only its own: a request's first token is streamed a step sooner (the engine
        # loop's delivery; None: everything is returned together)
        self.before_decode: Callable[[list[Event]], None] | None = None

    # ---- queue ----------------------------------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, trace_context=None,
            tree_cap: TreeCap | None = None) -> RunState:
        """Queue a request; `trace_context` (see `current_trace_context`) parents its spans on this thread;
        `tree_cap`: its own smaller tree shape (its trees are the service's, pruned to it)."""
        state = RunState(request_id, list(prompt_ids), sampling, trace_context=trace_context, tree_cap=tree_cap)
        self.waiting.append(state)
        return state

    def abort(self, request_id: str) -> None:
        """Takes effect at the start of the next step (call from the thread that runs `step`)."""
        self._aborts.add(request_id)

    def close(self) -> None:
        """Wait for verifies in flight and stop the overlap's worker (the engine thread is stopping); a prefill in
        flight is cancelled."""
        if self.overlap is not None:
            self.overlap.close()
        self._close_flights()

    @property
    def aborting(self) -> set[str]:
        """Ids whose abort waits for their verifies in flight to land (`abort`)."""
        return self._aborts

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts or self.flights.out)

    # ---- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        self.ended = {}
        events = self._apply_aborts()
        events += self._expire_blocked()
        t0, queued = time.perf_counter(), len(self.waiting)
        events += self._admit()
        took = time.perf_counter() - t0
        if len(self.waiting) < queued:  # an admission (or a refusal) happened: not a step with nothing to admit
            self.timings.admit_s += took
        if took > ADMISSION_NOTICED_S:
            self._admissions.append((t0, took))
            if self.policy is not None and self.policy.history is not None:
                self.policy.history.append(("admission", t0, took, len(self.running)))
        if self.running:
            if self.before_decode is not None and events:
                self.before_decode(events)  # first tokens (and aborts) out now, not after the decode
                events = []
            events += self._decode()
        elif self.waiting and self._retry_at:  # waiting for pages held elsewhere: do not spin
            time.sleep(max(0.0, self._retry_at - time.monotonic()))
        return events

    def _apply_aborts(self) -> list[Event]:
        events, later = [], set()
        in_flight = self.overlap.busy(self) if self.overlap is not None and self._aborts else set()
        if self.flights.out:  # their admission is in flight: aborted as it lands (`cancel_prefill` stops their
            in_flight |= self.flights.ids()  # Prefill meanwhile)
        for rid in self._aborts:
            if rid in in_flight:  # its verify is out: abort once it has landed
                later.add(rid)
                continue
            waiting = next((s for s in self.waiting if s.request_id == rid), None)
            if waiting is not None:
                self._end_waiting(waiting, events)
            elif rid in self.running:
                self._finish(rid, release_target=True)
                events.append(Event(rid, [], ABORT))
        self._aborts = later
        return events

    def _step_trace(self, states: list[RunState]) -> tuple[bool, Any, list]:
        """(sampled, parent context, links) for one step's spans over `states`."""
        if not self.step_spans.sample_step():
            return False, None, []
        parent, links = batch_parent([s.trace_context for s in states])
        return parent is not None, parent, links

    def _extend(self, extend: list, trace: tuple[bool, Any, list], name: str = "draft.extend") -> None:
        sampled, parent, links = trace
        t0 = time.perf_counter()
        with self.step_spans.span(name, sampled, links, parent, batch_size=len(extend)):
            self.draft.extend(extend)
            if name != "draft.extend":  # admission's and a catch-up's extends are timed to their end on the GPU
                self.draft.settle()
        if name == PROMPT_EXTEND:
            self.timings.prompt_extend_s += time.perf_counter() - t0
        else:
            self.timings.extend_s += time.perf_counter() - t0

    def _decode(self) -> list[Event]:
        if self.overlap is not None:
            return self.overlap.decode(self)
        return self.decode_now(list(self.running))

    def decode_now(self, rids: list[str], budget: int | None = None, chosen_at: int | None = None) -> list[Event]:
        """One synchronous step of `rids`: propose, verify, extend (`budget`, `chosen_at`: see `launch`)."""
        launch = self.launch(rids, budget=budget, chosen_at=chosen_at)
        try:
            outputs, error = self.verify(launch), None
        except SpecdecError as exc:
            outputs, error = None, exc
        return self.land(launch, outputs, error, launch.started)

    def launch(self, rids: list[str], budget: int | None = None, chosen_at: int | None = None,
               micro: bool = False, ahead: dict[str, int] | None = None) -> Launch:
        """Everything of a step before its verify: the budget, the draft's catch-up and trees. `budget`: already
        chosen (`choose_budget`), for a batch of `chosen_at` requests (default: these); `micro`: one of two
        micro-batches taking turns (`TwoBatchOverlap`); `ahead`: tokens the calls in flight before this one commit
        per request (pipelined plain calls)."""
        started = time.perf_counter()
        budget = self.choose_budget(rids) if budget is None else budget
        if self.policy is not None and self.draft is not None and budget != self._last_budget:
            # the previous budget's queued draft work (its extend) is not this step's: the policy compares the
            # budgets' own rates (one wait per switch)
            self.draft.settle()
            started = time.perf_counter()
        self._last_budget = budget
        speculate = self.draft is not None and budget != 0
        trace = sampled, parent, links = self._step_trace([self.running[rid] for rid in rids])
        if speculate:
            self._catch_up(rids, trace)
        # (a plain call proposes nothing: no propose span, as its phase metric records none, QA)
        with self.step_spans.span("draft.propose", sampled and speculate, links, parent, batch_size=len(rids)) as span:
            trees = self._propose(rids, budget) if speculate else [_EMPTY] * len(rids)
            plain = 1 if speculate else self._plain_steps_per_call(micro)
            # a plain call brings back the features of each request's last token only (see `_hold`)
            rows = 0 if speculate or self.draft is None else PLAIN_FEATURE_ROWS
            ramp = not speculate and not micro and plain < self.plain_steps
            ahead = ahead or {}
            generated = [self.running[rid].num_generated + ahead.get(rid, 0) for rid in rids]
            launch = Launch(rids, trees, budget, speculate, trace, started, [self.running[rid] for rid in rids],
                            plain, chosen_at, rows, ramp, generated)
            if span is not None:
                span.set_attribute("num_draft_tokens", launch.num_draft_tokens)
        return launch

    def _plain_steps_per_call(self, micro: bool) -> int:
        """`plain_steps`, but no more than PLAIN_STEPS (the target's own `Generate`) for one micro-batch of two
        taking turns (`TwoBatchOverlap`, only beside seeded requests): a long plain call would hold the target while
        the other's verify waits (measured: a 16-step call held it 8-12 ms a step). A plain call of the whole batch
        takes them all: at 128 requests of an 8B shape a call's round trip and bookkeeping cost ~6.5 ms, 16% of
        4 steps (2 x H200, `bench/services_gpu.sh`, session 8), once it has ramped up: after an admission, while
        the batch has room, calls start at what fits in `admit_window_s` (at least PLAIN_STEPS) and double (4, 8,
        16 for an 8B shape). Requests that arrive during a call join only after it (one burst of 32 came as waves
        of 2 and 30), and a 16-step call at 32 requests of an 8B shape is ~90 ms of waiting where `Generate` admits
        them within a step; a small model's steps (the tiny pair: under 1 ms) fit 16 in the window at once, where
        short calls would pay a round trip every few steps. One step while prompts are prefilled in parts."""
        if micro:
            return min(self.plain_steps, PLAIN_STEPS)
        if self.flights.out:  # a prompt is prefilled a part at a time meanwhile: a call of many steps would hold
            return 1  # its next part back (the target's Generate, 8B shape: an 8,000-token prompt's first token +31%)
        if len(self.running) >= self.max_batch_size:  # no one could join: the ramp is over
            self._plain_ramp = self.plain_steps
        fits = int(self.admit_window_s / self._plain_step_s) if self._plain_step_s else 0
        steps = min(self.plain_steps, max(self._plain_ramp, fits))
        self._plain_ramp = 2 * steps
        return steps

    def verify(self, launch: Launch) -> list:
        """The target's verdict on a launch's trees (callable from another thread: see `TwoBatchOverlap`)."""
        sampled, parent, links = launch.trace
        t0 = time.perf_counter()
        with self.step_spans.span("draft.verify", sampled, links, parent, batch_size=len(launch.rids),
                                  num_draft_tokens=launch.num_draft_tokens) as span:
            inputs, more = _verify_args(launch)
            outputs = self.target.verify(inputs, **more)
            if span is not None:
                span.set_attribute("accepted", sum(out.num_accepted_drafts for out in outputs))
        self.timings.verify_s += time.perf_counter() - t0
        return outputs

    def send(self, launch: Launch) -> SentVerify:
        """Start a launch's verify without waiting, on a target that can (`verify_start`: calls sent one after
        another from this thread reach it in that order); the result's `result()` waits for the outputs."""
        sampled, parent, links = launch.trace
        span = self.step_spans.start_span("draft.verify", sampled, links, parent, batch_size=len(launch.rids),
                                          num_draft_tokens=launch.num_draft_tokens)
        with trace.use_span(span, end_on_exit=False) if span is not None else contextlib.nullcontext():
            inputs, more = _verify_args(launch)
            pending = self.target.verify_start(inputs, **more)
        return SentVerify(self, pending, span, time.perf_counter())

    def _land_alone(self, launch: Launch, error: SpecdecError, since: float) -> list[Event]:
        """A verify refused for what one of its requests is (another client released it on the target or ran it
        ahead: NOT_FOUND, ABORTED; its tree refused): the target committed nothing, so each request's tree is
        verified again alone, and only those refused alone fail. Before, one outside Release or Verify naming one
        request ended every stream of its batch (QA)."""
        log.warning("verify of %d requests refused (%s): each verified alone", len(launch.rids), error)
        events: list[Event] = []
        for i in range(len(launch.rids)):
            if not self.is_current(launch, i):
                continue
            one = launch.only([i])
            try:
                outputs, alone = self.verify(one), None
            except SpecdecError as exc:
                outputs, alone = None, exc
            events += self.land(one, outputs, alone, since)
        return events

    def is_current(self, launch: Launch, i: int) -> bool:
        """Whether the request at `launch.rids[i]` is still running, as the request the launch was made for (not
        a new one under the same id)."""
        state = self.running.get(launch.rids[i])
        return state is launch.states[i]

    def land(self, launch: Launch, outputs: list | None, error: SpecdecError | None, since: float) -> list[Event]:
        """Commit a verify's outputs (or fail its requests on `error`), extend the draft over what was accepted.
        The step's time, for the timings and the policy, runs from `since` to now."""
        rids = launch.rids
        if error is not None and isinstance(error, ONE_REQUESTS) and len(rids) > 1:
            return self._land_alone(launch, error, since)
        if error is not None:  # the whole batch failed (e.g. the target went away)
            # not those an earlier landing ended, nor a new request under such a one's id (a client's retry once the
            # target is back: a pipelined call of the failed batch lands only then, QA)
            rids = [rid for i, rid in enumerate(rids) if self.is_current(launch, i)]
            # a target away, or requests it no longer holds (the gateway moved them on while it was frozen) are the
            # fleet's weather, logged as such; anything else (a malformed reply) is an error
            level = logging.WARNING if isinstance(error, (NotReady, UnknownRequest)) else logging.ERROR
            if rids:  # (a call of a batch an earlier landing failed: nothing left to tell)
                log.log(level, "verify failed for %d requests: %s", len(rids), error)
            away = isinstance(error, NotReady)
            for rid in rids:  # a target that answered (malformed reply) may still hold them
                self._finish(rid, release_target=not away)
            # a target away (stalled, cut off) may come back holding them: released then (`TargetClient.pending`)
            release_later = getattr(self.target, "release_later", None)  # (a target in-process is never away)
            if away and rids and release_later is not None:
                release_later(rids)
            return [Event(rid, [], ABORT, error=error) for rid in rids]
        events, extend, bounded = [], [], set()
        for i, (tree, out) in enumerate(zip(launch.trees, outputs, strict=True)):
            state = self.running.get(out.request_id)
            # an earlier plain call of the pipeline finished it (`TwoBatchOverlap`), or an earlier landing failed it
            # and this is a new request under its id
            if state is None or not self.is_current(launch, i):
                continue
            if self.policy is not None and out.finish_reason == RUNNING and self._near_limit(state, launch, tree):
                bounded.add(out.request_id)
            steps = len(out.tokens) if launch.plain_steps > 1 else 1  # a plain step commits one token
            self._count(state, len(tree.tokens), out.num_accepted_drafts, out.tokens, steps)
            events.append(Event(out.request_id, out.tokens, out.finish_reason,
                                num_accepted_drafts=out.num_accepted_drafts, from_verify=True,
                                num_draft_tokens=len(tree.tokens), num_steps=steps))
            if out.finish_reason != RUNNING:
                self._finish(out.request_id, release_target=False)  # the target freed its pages itself
            elif self.draft is not None and launch.speculate:
                extend.append((out.request_id, out.tokens, out.features))
            elif self.draft is not None:  # plain step: the draft catches up when speculation resumes
                self._hold(state, out.tokens, out.features)
        if extend:
            self._extend(extend, launch.trace)
        elapsed = time.perf_counter() - since
        # target steps run
        steps = max(1, max(len(out.tokens) for out in outputs)) if launch.plain_steps > 1 else 1
        if launch.speculate:
            self.timings.spec_steps += 1
            self.timings.spec_s += elapsed
        else:
            self.timings.plain_steps += steps
            self.timings.plain_s += elapsed
        ended = sum(e.finish_reason != RUNNING for e in events)
        if self.timings.calls is not None:
            self.timings.calls.append((launch.speculate, len(rids), steps, round(elapsed, 6), ended))
        # admissions on this thread since `since` (the target prefilled, the draft extended over prompts) are not
        # the step's time; an interval that was mostly admission says nothing of it (its verify ran meanwhile)
        admitting = sum(took for start, took in self._admissions if start >= since)
        if admitting > 0.5 * elapsed or self.flights.overlaps(since):
            return events
        elapsed -= admitting
        if not launch.speculate:
            self._plain_step_s = elapsed / steps
        # a ramp call's round trip weighs on 4-8 steps instead of `plain_steps`: it says how soon newcomers join,
        # not how fast plain decoding is (fed to the policy, 8B shape, tau 5, 64 requests: plain read 6988 tok/s,
        # `auto` speculated at 0.93x plain; without them plain read 9995 and the row was 1.01x; tenth pass). Nor is
        # a call in which a batch's requests end together that budget's pace: at 128 requests such calls (18-24
        # requests ending; the last, all of them, in fewer steps than asked) read 10.1-11.2 ms a plain step against
        # 8.1-8.5, and left plain's rate under the half chain's for the whole next batch (tau 3, H200, sixteenth
        # pass: 41 speculative steps at 0.94x plain's rate)
        ending = ended * ENDING_SHARE >= len(rids)
        if self.policy is not None and self.draft is not None and not (launch.ramp or ending):
            going = [e for e in events if e.finish_reason == RUNNING and e.request_id not in bounded]
            self.policy.record(len(rids), launch.budget, sum(len(e.tokens) for e in going), elapsed, steps,
                               len(going), launch.chosen_at, self._derived(launch, going))
        return events

    def _derived(self, launch: Launch, going: list[Event]) -> dict[int, int] | None:
        """What the menu's smaller speculative budgets would have committed for `going` in this step of chains
        (`SpeculationPolicy.derives_yields`): a budget of h keeps a chain's first h nodes, so a request that
        accepted a drafts would have accepted min(a, h), plus the target's own token."""
        if not (launch.speculate and self.policy.derives_yields):
            return None
        size = self.draft.spec.num_draft_tokens if launch.budget == FULL else launch.budget
        return {h: sum(1 + min(e.num_accepted_drafts, h) for e in going)
                for h in self.policy.budgets if h not in (0, FULL) and h < size}

    def _near_limit(self, state: RunState, launch: Launch, tree: TokenTree) -> bool:
        """Could the request's length limit (max_new_tokens, the context) have ended it in this call, before this
        call's outputs are counted? Such a request's yield is not the budget's: of those close to the limit only
        the ones that accepted little are still running after the call (at 64 requests, tau 3, 8B shape, H200 the
        last speculative steps read 1.4-2.6 tokens a step, the last plain call 0.02), and the policy read the
        budget it followed at a run's end as the slow one (`SpeculationPolicy.record`)."""
        most = max_depth(tree.parents) + 1 if launch.speculate else launch.plain_steps
        return state.room(self.max_context) <= most

    def fail_running(self, error: SpecdecError) -> list[Event]:
        """After a broken step: end every running request with `error` (verifies in flight are waited for
        first, so the target frees their pages after it has used them)."""
        if self.overlap is not None:
            self.overlap.abandon()
        rids = list(self.running)
        for rid in rids:
            self._finish(rid, release_target=True)
        return [Event(rid, [], ABORT, error=error) for rid in rids]

    def choose_budget(self, rids: list[str], batch_size: int | None = None) -> int:
        """Draft tokens to verify this step (0: plain decoding, FULL: the whole tree), chosen for a batch of
        `batch_size` requests (default: these; a micro-batch's choice is the whole running batch's)."""
        if self.draft is None:
            return 0
        if self.policy is None:
            return FULL
        if self.seeded(rids):
            return FULL
        return self.policy.choose(batch_size or len(rids))

    def seeded(self, rids: list[str]) -> bool:
        """Does any of these requests sample with a seed? It draws differently with other trees, so its steps stay
        on the whole tree (reproducible)."""
        return any(self.seeded_state(self.running[r]) for r in rids)

    @staticmethod
    def seeded_state(state: RunState) -> bool:
        return state.sampling.seed is not None and not state.sampling.greedy

    def _hold(self, state: RunState, tokens: list[int], features) -> None:
        """Keep what the draft needs of a plain call: its last tokens with their features (the call asked for
        `PLAIN_FEATURE_ROWS`); the draft leaves every earlier plain token out of its cache (`DraftEngine.skip`)
        and is extended over the kept ones when speculation resumes (`_catch_up`)."""
        rows = features.shape[0]
        self.draft.skip(state.request_id, len(state.backlog_tokens) + len(tokens) - rows)
        state.backlog_tokens, state.backlog_features = tokens[len(tokens) - rows :], features

    def _catch_up(self, rids: list[str], trace) -> None:
        """Extend the draft over the tokens that plain calls left it (`_hold`), so its state is current before
        proposing; timed with the speculative step that needs it."""
        items = []
        for rid in rids:
            state = self.running[rid]
            if state.backlog_tokens:
                items.append((rid, state.backlog_tokens, state.backlog_features))
                state.backlog_tokens, state.backlog_features = [], None
        if items:
            self._extend(items, trace, "draft.catch_up")

    def _propose(self, rids: list[str], budget: int = FULL) -> list:
        empty = _EMPTY
        if self.draft is None or not rids:
            return [empty] * len(rids)
        steps = self.draft.spec.num_steps
        eligible = [r for r in rids if self.draft.length(r) + steps < self.max_context]
        t0 = time.perf_counter()
        size = None if budget == FULL else budget
        proposed = dict(zip(eligible, self.draft.propose(eligible, size), strict=True)) if eligible else {}
        trees = []
        for rid in rids:  # a request with its own smaller shape gets the service's tree pruned to it
            tree, cap = proposed.get(rid, empty), self.running[rid].tree_cap
            trees.append(tree if cap is None else cap.prune(tree))
        self.timings.propose_s += time.perf_counter() - t0
        return trees

    def _count(self, state: RunState, num_drafts: int, num_accepted: int, tokens: list[int], steps: int) -> None:
        state.num_verify_steps += steps
        state.num_draft_tokens += num_drafts
        state.num_generated += len(tokens)
        if len(state.accepted_per_position) < num_accepted:
            state.accepted_per_position += [0] * (num_accepted - len(state.accepted_per_position))
        for i in range(num_accepted):
            state.accepted_per_position[i] += 1

    def _finish(self, rid: str, release_target: bool) -> None:
        state = self.running.pop(rid, None)
        if state is not None:
            self.ended[rid] = state
        if self.draft is not None and rid in self.draft.requests:
            self.draft.release(rid)
        if release_target:
            try:
                self.target.release(rid)
            except SpecdecError as exc:
                log.warning("release of %s on the target failed: %s", rid, exc)


def _verify_args(launch: Launch) -> tuple[list[VerifyInput], dict]:
    """The target call of a launch: its inputs, and the counts it sets (`plain_steps`, `feature_rows`)."""
    inputs = [VerifyInput(rid, list(t.tokens), list(t.parents), n)
              for rid, t, n in zip(launch.rids, launch.trees, launch.num_generated, strict=True)]
    more = {"plain_steps": launch.plain_steps} if launch.plain_steps > 1 else {}
    if launch.feature_rows:
        more["feature_rows"] = launch.feature_rows
    return inputs, more


class SentVerify:
    """A verify sent with `Scheduler.send`: `result()` waits for its outputs (once), ends its span and counts its
    time from the send."""

    def __init__(self, sched: Scheduler, pending, span, sent: float):
        self._sched, self._pending, self._span, self._sent = sched, pending, span, sent
        self._outputs = None

    def result(self) -> list:
        if self._outputs is None:
            try:
                self._outputs = self._sched.target.verify_finish(self._pending)
                if self._span is not None:
                    self._span.set_attribute("accepted", sum(out.num_accepted_drafts for out in self._outputs))
            finally:
                if self._span is not None:
                    self._span.end()
                    self._span = None
            self._sched.timings.verify_s += time.perf_counter() - self._sent
        return self._outputs
