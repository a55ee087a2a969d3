"""Engines over the shipped tiny pair, built once per test session (fp32 on CPU)."""

from __future__ import annotations

from functools import lru_cache

from repo_paths import TINY

from specdec.engine.draft_engine import SpecConfig
from specdec.engine.factory import EngineOptions, build_draft, build_target

OPTS = EngineOptions(num_pages=2048, max_batch_size=16)


@lru_cache(maxsize=1)
def tiny_target():
    return build_target(str(TINY / "target"), OPTS)


def tiny_draft(kind: str = "draft", spec: SpecConfig = SpecConfig(5, 1, 5)):
    return build_draft(str(TINY / kind), str(TINY / "target"), spec, OPTS, tiny_target().max_context)
