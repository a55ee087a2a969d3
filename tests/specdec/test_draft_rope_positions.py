"""An EAGLE head whose config lists a shorter `max_position_embeddings` than its target's (EAGLE3-LLaMA3.1-Instruct-8B
lists 2048 for a 131072-position target; a yarn target's is the stretched one) serves the target's whole context.
Before, the head's rope table had its own config's length and a request past it failed the draft's step
(IndexError: index 64 is out of bounds for dimension 0 with size 64)."""

from __future__ import annotations

import json

import pytest
from core_checkpoints import make_eagle, make_llama_target

from specdec.engine.draft_engine import SpecConfig
from specdec.engine.factory import EngineOptions, build_draft, build_target
from specdec.engine.generate import generate
from specdec.sampling_params import SamplingParams

YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_a_head_with_a_shorter_context_than_its_target_serves_the_targets(tmp_path, kind):
    target = make_llama_target(tmp_path / "t", shard=False, rope_scaling=YARN)  # max_position_embeddings 256
    head = make_eagle(tmp_path / "d", json.loads((target / "config.json").read_text()), kind)
    cfg = json.loads((head / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (head / "config.json").write_text(json.dumps(cfg))
    opts = EngineOptions(num_pages=256, max_batch_size=2)
    t = build_target(str(target), opts)
    d = build_draft(str(head), str(target), SpecConfig(4, 1, 4), opts, t.max_context)
    assert d.model.rope.cos.shape[0] >= t.max_context
    prompts = [list(range(3, 90)), [5, 6, 7]]
    params = SamplingParams(max_new_tokens=80, ignore_eos=True)
    plain = generate(t, None, prompts, params)
    spec = generate(t, d, prompts, params)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert all(len(r.tokens) == 80 for r in spec)
