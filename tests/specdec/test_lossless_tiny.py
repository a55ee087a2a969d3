"""Greedy speculative output == greedy target-only output on the shipped trained pair (EAGLE-1 and EAGLE-3),
for chain and tree settings; acceptance on held-out prompts is in the range the pair's README reports."""

from __future__ import annotations

import pytest
from core_engines import tiny_draft, tiny_target

from specdec.engine.draft_engine import SpecConfig
from specdec.engine.generate import generate
from specdec.sampling_params import SamplingParams

SETTINGS = {
    "chain5": SpecConfig(5, 1, 5),
    "tree-s4k4d12": SpecConfig(4, 4, 12),
}


# 16 prompts: with 6 the acceptance of one setting moved by ~0.4 when a prompt changed (a fresh clone's prompts are
# the project's own function openings, which change with its code; EAGLE-3's tree read 3.296 against 3.656 on
# ../shared's), more than the margin its bound leaves
NUM_PROMPTS = 16


@pytest.fixture(scope="module")
def prompts(dev_prompts, tiny_tokenizer):
    return [tiny_tokenizer.encode(p)[-128:] for p in dev_prompts[:NUM_PROMPTS]]


@pytest.fixture(scope="module")
def plain(prompts):
    return generate(tiny_target(), None, prompts, SamplingParams(max_new_tokens=40), max_batch_size=NUM_PROMPTS)


@pytest.mark.parametrize("kind", ["draft", "draft-eagle3"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_speculative_equals_plain(kind, setting, prompts, plain):
    target = tiny_target()
    draft = tiny_draft(kind, SETTINGS[setting])
    spec = generate(target, draft, prompts, SamplingParams(max_new_tokens=40), max_batch_size=NUM_PROMPTS)
    for s, p in zip(spec, plain, strict=True):
        assert s.tokens == p.tokens
        assert s.finish_reason == p.finish_reason
    steps = sum(r.num_verify_steps for r in spec)
    tau = sum(len(r.tokens) - 1 for r in spec) / steps
    # README of the pair: tau 3.78 (EAGLE-1) / 3.90 (EAGLE-3) for the 5-step chain over 50 prompts; here, 16
    # prompts of ../shared: 3.30 / 3.76 (chains), 3.74 / 3.74 (trees); of the project's own code: 3.10 / 3.01, 3.57 /
    # 3.51 (session 19)
    assert tau > (2.8 if setting == "chain5" else 3.3), tau
    assert target.kv.num_free_pages == target.kv.num_total_pages and target._reserved == 0
    assert draft.kv.num_free_pages == draft.kv.num_total_pages and not draft.requests


def test_sampling_with_seed_is_reproducible(prompts):
    target, draft = tiny_target(), tiny_draft("draft", SpecConfig(4, 2, 6))
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_new_tokens=24)
    a = generate(target, draft, prompts[:3], params)
    b = generate(target, draft, prompts[:3], params)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert any(r.num_verify_steps < 23 for r in a)  # speculation actually accepted something
