"""The shipped tiny pair and held-out dev prompts for in-process CPU benchmarks (fp32, torch attention)."""

from __future__ import annotations

import json
from pathlib import Path

from specdec.engine.draft_engine import SpecConfig
from specdec.engine.factory import EngineOptions, build_draft, build_target
from specdec.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "tiny-code"
DEV_PROMPTS = ROOT.parent / "shared" / "prompts" / "dev.jsonl"


def tiny_pair(draft_kind: str, max_batch_size: int, spec: SpecConfig = SpecConfig(5, 1, 5)):
    """(target, draft) on the CPU; `draft_kind`: draft (EAGLE-1) or draft-eagle3."""
    opts = EngineOptions(device="cpu", dtype="float32", attention_backend="torch", max_batch_size=max_batch_size,
                         num_pages=8192)
    target = build_target(str(TINY / "target"), opts)
    return target, build_draft(str(TINY / draft_kind), str(TINY / "target"), spec, opts, target.max_context)


def dev_prompts(n: int, last_tokens: int) -> list[list[int]]:
    """The last `last_tokens` tokens of dev prompts 60.. (held apart from the tests' range)."""
    tok = load_tokenizer(TINY / "target")
    lines = [json.loads(x)["prompt"] for x in DEV_PROMPTS.read_text().splitlines() if x.strip()]
    return [tok.encode(lines[60 + i])[-last_tokens:] for i in range(n)]
