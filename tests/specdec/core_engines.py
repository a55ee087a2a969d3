"""Engines over the shipped tiny pair, built once per test session (fp32 on CPU), and a loop that drives a scheduler."""

from __future__ import annotations

from functools import lru_cache

from repo_paths import TINY

from specdec.engine.draft_engine import SpecConfig
from specdec.engine.factory import EngineOptions, build_draft, build_target

OPTS = EngineOptions(num_pages=2048, max_batch_size=16)


@lru_cache(maxsize=1)
def tiny_target():
    return build_target(str(TINY / "target"), OPTS)


def restored_target():
    """For a fixture (`yield from`): the tiny target; its part size restored and its requests released after."""
    engine = tiny_target()
    before = engine.prefill_chunk_tokens
    yield engine
    engine.prefill_chunk_tokens = before
    for rid in list(engine.requests):
        engine.release(rid)


def tiny_draft(kind: str = "draft", spec: SpecConfig = SpecConfig(5, 1, 5)):
    return build_draft(str(TINY / kind), str(TINY / "target"), spec, OPTS, tiny_target().max_context)


def drive(scheduler, prompts, params, on_step=None) -> dict[str, list[int]]:
    """Add the prompts as r0, r1, ... and step `scheduler` until it is idle (no event may carry an error);
    `on_step(scheduler)` after each step. Returns each request's tokens."""
    out = {f"r{i}": [] for i in range(len(prompts))}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        scheduler.add(f"r{i}", prompt, p)
    while scheduler.has_work:
        for ev in scheduler.step():
            assert ev.error is None
            out[ev.request_id] += ev.tokens
        if on_step is not None:
            on_step(scheduler)
    return out
