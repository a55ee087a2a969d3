"""What the scheduler keeps per request and hands out per step: `RunState` (a request in the queue or the running
batch), `Event` (what one request got from one step), `Launch` (one step up to its verify)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from specdec.engine.finish import length_room
from specdec.engine.requests import RUNNING
from specdec.errors import SpecdecError
from specdec.sampling_params import SamplingParams
from specdec.tree import TokenTree, TreeCap


@dataclass
class Event:
    """What one request got from one step."""

    request_id: str
    tokens: list[int]
    finish_reason: str = RUNNING
    error: SpecdecError | None = None
    num_accepted_drafts: int = 0
    from_verify: bool = False  # False for the prefill's first token and for aborts
    num_draft_tokens: int = 0  # draft tokens the step verified for this request (0: a plain step)
    num_steps: int = 1  # target steps behind `tokens`: one per token when a call ran several plain steps


@dataclass
class RunState:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    num_generated: int = 0
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    blocked_since: float | None = None  # when admission first found the KV pools too full for it
    arrived: float = field(default_factory=time.monotonic)  # when it was queued (`Scheduler.add`)
    trace_context: Any = None  # the request's OpenTelemetry context (None: not traced)
    # committed tokens (and their features [n, feature]) the draft has not extended over yet: left by plain calls
    backlog_tokens: list[int] = field(default_factory=list)
    backlog_features: Any = None
    tree_cap: TreeCap | None = None  # the request's own smaller tree shape (None: the service's)

    def room(self, max_context: int) -> int:
        """Tokens the request may still commit before a length limit ends it (max_new_tokens, the context)."""
        return length_room(self.sampling, self.num_generated, len(self.prompt_ids) + self.num_generated, max_context)


@dataclass
class Launch:
    """One step of a set of running requests up to its verify: what was proposed, and how the step is traced."""

    rids: list[str]
    trees: list[TokenTree]
    budget: int
    speculate: bool
    trace: tuple[bool, Any, list]
    started: float  # perf_counter at the start of the step
    # [len(rids)] the requests' RunStates at the launch: a request that ended while this call was in flight (the
    # target went away) may be followed by a new one under the same id, which this call's landing must not touch
    # (`Scheduler.is_current`)
    states: list
    plain_steps: int = 1  # plain decode steps the verify call runs (> 1: see specdec.engine.plain_steps)
    chosen_at: int | None = None  # the batch size the budget was chosen for, when not len(rids) (see overlap)
    feature_rows: int = 0  # > 0: the verify returns the features of each request's last that many tokens only
    ramp: bool = False  # a whole-batch plain call shortened after an admission (`Scheduler._plain_steps_per_call`)
    # [len(rids)] tokens each request will have generated when the target runs this call (its count at the launch,
    # plus what the calls in flight ahead of it commit): sent with the call, which the target refuses if it runs
    # out of order (`VerifyInput.num_generated`)
    num_generated: list[int] = field(default_factory=list)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(t.tokens) for t in self.trees)

    def only(self, indices: list[int]) -> Launch:
        """This launch for the requests at `indices` alone (their trees and counts)."""
        if len(indices) == len(self.rids):
            return self
        return replace(self, rids=[self.rids[i] for i in indices], trees=[self.trees[i] for i in indices],
                       num_generated=[self.num_generated[i] for i in indices] if self.num_generated else [],
                       states=[self.states[i] for i in indices])
