"""The speculative loop over a running batch (continuous batching), independent of transport.

One `step()`: admit waiting requests (target prefill, draft extend over the prompt), then for the running batch
propose trees (draft), verify them in one call (target), and extend the draft over what was accepted. With no
draft the same loop is plain decoding (empty trees). `target` is anything with the TargetEngine methods
`prefill`, `verify` and `release`: the engine itself in-process, or the draft service's gRPC client.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from specdec.engine.draft_engine import DraftEngine
from specdec.engine.requests import ABORT, RUNNING, PrefillInput, StepTimings, VerifyInput
from specdec.errors import SpecdecError
from specdec.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Event:
    """What one request got from one step."""

    request_id: str
    tokens: list[int]
    finish_reason: str = RUNNING
    error: SpecdecError | None = None
    num_accepted_drafts: int = 0
    from_verify: bool = False  # False for the prefill's first token and for aborts


@dataclass
class RunState:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    num_generated: int = 0
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, target, draft: DraftEngine | None, max_context: int, max_batch_size: int = 64,
                 feature_layers: tuple[int, ...] = ()):
        self.target, self.draft = target, draft
        self.max_context, self.max_batch_size = max_context, max_batch_size
        self.feature_layers = feature_layers
        self.waiting: deque[RunState] = deque()
        self.running: dict[str, RunState] = {}
        self._aborts: set[str] = set()
        self.timings = StepTimings()

    # ---- queue ----------------------------------------------------------------------------------------------
    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> RunState:
        state = RunState(request_id, list(prompt_ids), sampling)
        self.waiting.append(state)
        return state

    def abort(self, request_id: str) -> None:
        """Takes effect at the start of the next step (call from the thread that runs `step`)."""
        self._aborts.add(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    # ---- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        events = self._apply_aborts()
        events += self._admit()
        if self.running:
            events += self._decode()
        return events

    def _apply_aborts(self) -> list[Event]:
        events = []
        for rid in self._aborts:
            waiting = next((s for s in self.waiting if s.request_id == rid), None)
            if waiting is not None:
                self.waiting.remove(waiting)
                events.append(Event(rid, [], ABORT))
            elif rid in self.running:
                self._finish(rid, release_target=True)
                events.append(Event(rid, [], ABORT))
        self._aborts.clear()
        return events

    def _admit(self) -> list[Event]:
        events, extend = [], []
        while self.waiting and len(self.running) < self.max_batch_size:
            state = self.waiting.popleft()
            rid = state.request_id
            try:
                if self.draft is not None:
                    self.draft.add(rid, len(state.prompt_ids) + state.sampling.max_new_tokens)
                out = self.target.prefill([PrefillInput(rid, state.prompt_ids, state.sampling,
                                                        self.feature_layers, self.draft is not None)])[0]
            except SpecdecError as exc:
                if self.draft is not None and rid in self.draft.requests:
                    self.draft.release(rid)
                events.append(Event(rid, [], ABORT, error=exc))
                continue
            state.num_generated = 1
            events.append(Event(rid, [out.first_token], out.finish_reason))
            if out.finish_reason != RUNNING:
                if self.draft is not None:
                    self.draft.release(rid)
                continue
            self.running[rid] = state
            if self.draft is not None:
                extend.append((rid, state.prompt_ids[1:] + [out.first_token], out.features))
        if extend:
            t0 = time.perf_counter()
            self.draft.extend(extend)
            self.timings.extend_s += time.perf_counter() - t0
        return events

    def _decode(self) -> list[Event]:
        rids = list(self.running)
        trees = self._propose(rids)
        t0 = time.perf_counter()
        try:
            outputs = self.target.verify(
                [VerifyInput(rid, list(t.tokens), list(t.parents)) for rid, t in zip(rids, trees, strict=True)]
            )
        except SpecdecError as exc:  # the whole batch failed (e.g. the target went away)
            log.error("verify failed for %d requests: %s", len(rids), exc)
            for rid in rids:
                self._finish(rid, release_target=False)
            return [Event(rid, [], ABORT, error=exc) for rid in rids]
        self.timings.verify_s += time.perf_counter() - t0
        events, extend = [], []
        for tree, out in zip(trees, outputs, strict=True):
            state = self.running[out.request_id]
            self._count(state, len(tree.tokens), out.num_accepted_drafts, out.tokens)
            events.append(Event(out.request_id, out.tokens, out.finish_reason,
                                num_accepted_drafts=out.num_accepted_drafts, from_verify=True))
            if out.finish_reason != RUNNING:
                self._finish(out.request_id, release_target=False)  # the target freed its pages itself
            elif self.draft is not None:
                extend.append((out.request_id, out.tokens, out.features))
        if extend:
            t0 = time.perf_counter()
            self.draft.extend(extend)
            self.timings.extend_s += time.perf_counter() - t0
        return events

    def _propose(self, rids: list[str]) -> list:
        from specdec.tree import TokenTree

        empty = TokenTree((), ())
        if self.draft is None:
            return [empty] * len(rids)
        steps = self.draft.spec.num_steps
        eligible = [r for r in rids if self.draft.length(r) + steps < self.max_context]
        t0 = time.perf_counter()
        proposed = dict(zip(eligible, self.draft.propose(eligible), strict=True)) if eligible else {}
        self.timings.propose_s += time.perf_counter() - t0
        return [proposed.get(r, empty) for r in rids]

    def _count(self, state: RunState, num_drafts: int, num_accepted: int, tokens: list[int]) -> None:
        state.num_verify_steps += 1
        state.num_draft_tokens += num_drafts
        state.num_generated += len(tokens)
        if len(state.accepted_per_position) < num_accepted:
            state.accepted_per_position += [0] * (num_accepted - len(state.accepted_per_position))
        for i in range(num_accepted):
            state.accepted_per_position[i] += 1

    def _finish(self, rid: str, release_target: bool) -> None:
        self.running.pop(rid, None)
        if self.draft is not None and rid in self.draft.requests:
            self.draft.release(rid)
        if release_target:
            try:
                self.target.release(rid)
            except SpecdecError as exc:
                log.warning("release of %s on the target failed: %s", rid, exc)
