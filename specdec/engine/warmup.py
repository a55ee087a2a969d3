"""Start-up warm-up of the verify shapes a draft will send, so that no request pays for a CUDA-graph capture.

A target captures its verify graphs the first time a shape arrives (tokens per request, feature layers, chain or
tree): a whole ladder of batch sizes at once, 0.1-1 s. Without a warm-up the first speculative step of a service
pays that, and `--speculation auto` takes the stalled step for the budget's speed (the tiny pair through the
services on an H200: 0.17x plain decoding at one request, the policy stuck on plain steps). The draft knows its
shapes (`budget_menu`, topk), so it sends each once, for a throw-away request, before it serves.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid

from opentelemetry import context as otel_context

from specdec.engine.requests import PrefillInput, VerifyInput
from specdec.errors import SpecdecError
from specdec.request_ids import WARMUP_PREFIX
from specdec.sampling_params import SamplingParams
from specdec.telemetry.tracing import attached, untraced_context

log = logging.getLogger(__name__)
WARMUP_PROMPT_LEN = 16


def warmup_trees(sizes: list[int], topk: int) -> list[list[int]]:
    """Parent lists covering the verify shapes of trees of `sizes` nodes: an empty tree (a plain step), a chain
    of each size, and for topk > 1 a branching tree of each size too (a tree's best nodes may or may not
    branch)."""
    trees: list[list[int]] = [[]]
    for n in dict.fromkeys(s for s in sizes if s > 0):
        trees.append(list(range(-1, n - 1)))
        if topk > 1 and n >= 2:
            trees.append([-1, -1, *range(n - 2)])
    return trees


def warm_verify_shapes(target, sizes: list[int], topk: int, feature_layers: tuple[int, ...], vocab_size: int,
                       features: bool = True) -> None:
    """Verify each of `warmup_trees(sizes, topk)` once on `target` (an engine or a remote client) for a throw-away
    request, sampled out of tracing (no trace of it reaches the collector); `features`: as the draft's requests
    (False: `--speculation off`). A failure is logged, not raised: the service still starts, and its first steps
    pay the captures."""
    with attached(untraced_context()):
        _warm(target, sizes, topk, feature_layers, vocab_size, features)


def _warm(target, sizes: list[int], topk: int, feature_layers: tuple[int, ...], vocab_size: int,
          features: bool = True) -> None:
    trees = warmup_trees(sizes, topk)
    rid = f"{WARMUP_PREFIX}{uuid.uuid4().hex[:12]}"
    prompt = [i % vocab_size for i in range(WARMUP_PROMPT_LEN)]
    budget = sum(len(p) + 1 for p in trees) + 1  # every verify commits at most its tree plus one token
    t0 = time.perf_counter()
    try:
        # with features as the draft's requests ask: its client checks that every verify result carries them
        target.prefill([PrefillInput(rid, prompt, SamplingParams(max_new_tokens=budget, ignore_eos=True),
                                     feature_layers, features, trace_context=otel_context.get_current())])
    except SpecdecError as exc:
        log.warning("verify warm-up skipped (prefill failed: %s); the first steps may pay CUDA-graph captures", exc)
        return
    try:
        for parents in trees:
            target.verify([VerifyInput(rid, [1 % vocab_size] * len(parents), parents)])
        log.info("verify warm-up: %d shapes (tree sizes %s, topk %d) in %.2f s", len(trees),
                 sorted({len(p) for p in trees}), topk, time.perf_counter() - t0)
    except SpecdecError as exc:
        log.warning("verify warm-up stopped (%s); the first steps may pay CUDA-graph captures", exc)
    finally:
        with contextlib.suppress(SpecdecError):  # finished (the target released it) or the target went away
            target.release(rid)
