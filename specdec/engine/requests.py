"""Plain dataclasses that cross the engine boundary (the services turn protobuf into these and back)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from specdec.sampling_params import SamplingParams

# finish reasons (the strings map 1:1 onto the protobuf enum at the service edge)
RUNNING = ""
STOP = "stop"  # EOS or a stop token id
LENGTH = "length"  # max_new_tokens or the context length
ABORT = "abort"


def kept_feature_rows(tokens: int, feature_rows: int) -> int:
    """Feature rows a result of `tokens` tokens carries when its call asked for `feature_rows` (0: all; N > 0: the
    last N, Prefill and Verify alike)."""
    return min(tokens, feature_rows or tokens)


@dataclass(frozen=True)
class PrefillInput:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    feature_layers: tuple[int, ...] = ()  # () = final normed hidden (EAGLE-1), else aux layer inputs (EAGLE-3)
    return_features: bool = True
    # the request's OpenTelemetry context: a remote target's Prefill RPC joins the request's trace
    trace_context: Any = field(default=None, compare=False, repr=False)
    feature_wire: str = ""  # how a remote draft wants the features sent ("" or tensor_codec.FP8_ROWS)
    feature_rows: int = 0  # > 0: the features of the last that many prompt tokens only
    queue_for_pages: bool = False  # refused for lack of KV pages, the caller asks again: keep its place (page_queue)


@dataclass
class PrefillOutput:
    request_id: str
    first_token: int
    features: torch.Tensor | None  # [num_prompt_tokens, feature_size]
    finish_reason: str = RUNNING


@dataclass(frozen=True)
class VerifyInput:
    request_id: str
    draft_tokens: list[int]  # [num_draft_tokens]; empty = a plain decode step
    parents: list[int]  # [num_draft_tokens], -1 = root
    # tokens the request has generated (the prefill's first included) when this call runs, as the caller counts
    # them: the target refuses a call that disagrees (`OutOfOrder`); 0: not checked
    num_generated: int = 0


@dataclass
class VerifyOutput:
    request_id: str
    tokens: list[int]  # accepted draft tokens then the bonus token, cut at a finish
    num_accepted_drafts: int
    features: torch.Tensor | None  # [len(tokens), feature_size]: root and accepted positions
    finish_reason: str = RUNNING


@dataclass
class StepTimings:
    """Seconds a scheduler spent, by part (host clock; each step ends with a host sync)."""

    propose_s: float = 0.0
    verify_s: float = 0.0
    extend_s: float = 0.0  # the draft's extend over verified tokens (and the catch-up over plain steps' tokens)
    admit_s: float = 0.0  # admissions: target prefill + draft extend over the prompts
    prompt_extend_s: float = 0.0  # the draft's extend over admitted prompts (part of admit_s, not of extend_s)
    plain_steps: int = 0
    plain_s: float = 0.0  # whole decode steps that verified nothing (plain decoding)
    spec_steps: int = 0
    spec_s: float = 0.0  # whole speculative steps (catch-up, propose, verify, extend)
    # a list: every landed call appended as (speculative, requests, target steps, seconds, requests that ended in
    # it), benchmarks' per-call view (None: not kept)
    calls: list | None = None


@dataclass
class GenerationResult:
    request_id: str
    prompt_len: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = RUNNING
    num_verify_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [max_depth] accepted counts
    num_draft_tokens: int = 0  # draft tokens proposed over the request's life
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed by each verify step

    @property
    def tau(self) -> float:
        """Tokens committed per target verify step (bonus included); the prefill's first token excluded."""
        return (len(self.tokens) - 1) / self.num_verify_steps if self.num_verify_steps else 0.0
