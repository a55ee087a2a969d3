"""A long prompt prefilled in parts (`specdec.engine.prefill_parts`) gives what one forward gives: the same first
token, the same features (fp32, within the rounding of a differently summed attention), and the same tokens after;
a verify naming it mid-way is refused, and a release mid-way frees its pages."""

from __future__ import annotations

import pytest
import torch
from core_engines import restored_target

from specdec.engine.requests import PrefillInput, VerifyInput
from specdec.errors import DuplicateRequest, InvalidInput, UnknownRequest
from specdec.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture
def target():
    yield from restored_target()


def _prompt(n: int) -> list[int]:
    return [(17 * i + 5) % 8000 + 10 for i in range(n)]


def _run(target, rid: str, chunk: int, layers=(), feature_rows=0):
    """Prefill in parts of `chunk` tokens (0: one forward), then three greedy chain verifies of made-up drafts."""
    target.prefill_chunk_tokens = chunk
    out = target.prefill([PrefillInput(rid, _prompt(300), GREEDY, layers, feature_rows=feature_rows)])[0]
    tokens, drafts = [out.first_token], [5, 6, 7]
    for _ in range(3):
        v = target.verify([VerifyInput(rid, drafts, [-1, 0, 1])])[0]
        tokens += v.tokens
    target.release(rid)
    return out, tokens


@pytest.mark.parametrize("layers, feature_rows", [((), 0), ((2, 4, 7), 0), ((), 40)])
def test_parts_give_what_one_forward_gives(target, layers, feature_rows):
    whole, whole_tokens = _run(target, "whole", 0, layers, feature_rows)
    parts, parts_tokens = _run(target, "parts", 64, layers, feature_rows)  # 300 tokens: parts of 64, the last 44
    assert parts.first_token == whole.first_token
    assert parts_tokens == whole_tokens
    width = target.cfg.hidden_size * max(1, len(layers))
    assert parts.features.shape == whole.features.shape == (feature_rows or 300, width)
    torch.testing.assert_close(parts.features, whole.features, atol=2e-4, rtol=1e-4)
    assert target.kv.reserved_by_requests == 0 and not target.prefilling


def test_a_request_mid_prefill_is_not_verified_and_its_release_frees_its_pages(target):
    target.prefill_chunk_tokens = 100
    free = target.kv.num_free_pages
    target.begin_prefill(PrefillInput("p", _prompt(300), GREEDY))
    assert target.prefill_part("p") is None  # 100 of 300
    assert target.requests["p"].kv_len == 100
    with pytest.raises(InvalidInput, match="still being prefilled"):
        target.verify([VerifyInput("p", [], [])])
    target.release("p")
    assert target.kv.num_free_pages == free and not target.prefilling
    with pytest.raises(UnknownRequest):
        target.prefill_part("p")


def test_a_failed_part_releases_the_request(target, monkeypatch):
    target.prefill_chunk_tokens = 100
    free = target.kv.num_free_pages
    target.begin_prefill(PrefillInput("f", _prompt(300), GREEDY))
    target.prefill_part("f")
    monkeypatch.setattr(target.model, "compute_logits", lambda h: (_ for _ in ()).throw(RuntimeError("boom")))
    target.prefill_part("f")  # 200 of 300: no logits yet
    with pytest.raises(RuntimeError, match="boom"):
        target.prefill_part("f")
    assert "f" not in target.requests and not target.prefilling and target.kv.num_free_pages == free


def test_a_short_prompt_and_a_group_run_in_one_forward(target, monkeypatch):
    target.prefill_chunk_tokens = 100
    calls = []
    monkeypatch.setattr(target, "_run_part", lambda part: calls.append(part))
    outs = target.prefill([PrefillInput("a", _prompt(100), GREEDY), PrefillInput("b", _prompt(150), GREEDY)])
    assert [o.request_id for o in outs] == ["a", "b"] and not calls


def test_a_refused_duplicate_leaves_the_request_under_its_id_alone(target):
    """QA: a second Prefill under a running request's id (refused, ALREADY_EXISTS) released the first when the second
    prompt was long enough for parts: the first's next part, or its next verify, then found nothing."""
    target.prefill_chunk_tokens = 100
    target.begin_prefill(PrefillInput("d", _prompt(300), GREEDY))
    target.prefill_part("d")
    with pytest.raises(DuplicateRequest):
        target.begin_prefill(PrefillInput("d", _prompt(250), GREEDY))
    while (out := target.prefill_part("d")) is None:
        pass
    assert out.request_id == "d" and target.requests["d"].kv_len == 300
    with pytest.raises(DuplicateRequest):  # decoding now: a long duplicate is refused, the request goes on
        target.prefill([PrefillInput("d", _prompt(250), GREEDY)])
    assert target.verify([VerifyInput("d", [], [])])[0].tokens
