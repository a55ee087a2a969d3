"""A plain call asks for the features of each request's last token only and the draft leaves the rest of the stretch
out of its cache (`Scheduler._hold`, `DraftEngine.skip`); where the policy decodes plainly, admission does the same
with the prompt (`Admission._prompt_feature_rows`): the tokens stay the target's, later positions stay true, the
draft holds one token to catch up on at most, and nothing leaks."""

from __future__ import annotations

import pytest
import torch
from core_engines import drive, tiny_draft, tiny_target

from specdec.engine.adaptive import FULL, SpeculationPolicy
from specdec.engine.generate import feature_layers_for
from specdec.engine.requests import PrefillInput, VerifyInput
from specdec.engine.scheduler import Scheduler
from specdec.errors import InvalidInput
from specdec.sampling_params import SamplingParams


def test_plain_leads_only_where_the_menu_is_measured_and_plain_decoding_is_fastest():
    p = SpeculationPolicy((0, FULL), min_samples=2, min_request_steps=1)
    assert not p.plain_leads(8)
    for _ in range(6):  # plain twice, then the whole tree twice: measured, plain faster
        budget = p.choose(8)
        p.record(8, budget, tokens=80 if budget == 0 else 40, seconds=1.0)
    assert p.plain_leads(8) and p.plain_leads(5)  # the same bucket
    assert not p.plain_leads(64)  # another bucket, not measured yet
    for _ in range(6):
        budget = p.choose(64)
        p.record(64, budget, tokens=640 if budget == 0 else 900, seconds=1.0)
    assert not p.plain_leads(64)  # speculation leads there


@pytest.mark.parametrize("layers", [(), (1, 2)])  # EAGLE-1's final hidden state, EAGLE-3's layer inputs
def test_prefill_returns_the_features_of_the_last_prompt_tokens_when_asked(layers):
    target = tiny_target()
    prompt, params = list(range(300, 340)), SamplingParams(max_new_tokens=4)
    with pytest.raises(InvalidInput, match="feature_rows"):
        target.prefill([PrefillInput("bad", prompt, params, layers, feature_rows=-1)])
    assert "bad" not in target.requests
    full, last = target.prefill([PrefillInput("all", prompt, params, layers),
                                 PrefillInput("last", prompt, params, layers, feature_rows=3)])
    try:
        assert full.features.shape[0] == 40 and last.features.shape[0] == 3
        assert torch.allclose(last.features, full.features[-3:], atol=1e-5)
        assert last.first_token == full.first_token
    finally:
        target.release("all")
        target.release("last")


def _admit(target, rids: list[str]) -> None:
    target.prefill([PrefillInput(rid, list(range(300, 340)), SamplingParams(max_new_tokens=20, ignore_eos=True))
                    for rid in rids])


def test_verify_returns_the_features_of_the_last_tokens_when_asked():
    target = tiny_target()
    try:
        _admit(target, ["all", "last"])
        full = target.verify([VerifyInput("all", [], [])], plain_steps=4)[0]
        with pytest.raises(InvalidInput, match="feature_rows"):
            target.verify([VerifyInput("last", [], [])], plain_steps=4, feature_rows=-1)
        last = target.verify([VerifyInput("last", [], [])], plain_steps=4, feature_rows=1)[0]
        assert last.tokens == full.tokens and len(full.tokens) == 4  # the refused call committed nothing
        assert full.features.shape[0] == 4 and last.features.shape[0] == 1
        assert torch.allclose(last.features, full.features[-1:], atol=1e-6)
        two = target.verify([VerifyInput("last", [], [])], feature_rows=2)[0]  # one token: its one row
        assert two.features.shape[0] == 1
    finally:
        for rid in ("all", "last"):
            target.release(rid)


def test_skipped_positions_move_later_tokens_without_caching_anything_for_them():
    """RoPE sees relative positions only: two requests that skip the same stretch get the same proposal whatever
    their absolute start, and one that does not skip (the same tokens, closer together) gets another state."""
    draft = tiny_draft()
    gen = torch.Generator().manual_seed(0)
    width = draft.model.feature_size
    a, b = list(range(500, 530)), list(range(700, 706))
    fa, fb = torch.randn(len(a), width, generator=gen), torch.randn(len(b), width, generator=gen)
    for rid in ("skip", "shifted", "dense"):
        draft.add(rid, 200)
    try:
        draft.skip("shifted", 5)  # the same layout, every position 5 further on
        draft.extend([(rid, a, fa) for rid in ("skip", "shifted", "dense")])
        draft.skip("skip", 40)
        draft.skip("shifted", 40)
        draft.extend([(rid, b, fb) for rid in ("skip", "shifted", "dense")])
        assert draft.length("skip") == len(a) + 40 + len(b) and draft.length("dense") == len(a) + len(b)
        assert draft.requests["skip"].kv_len == draft.requests["dense"].kv_len == len(a) + len(b)
        assert draft.length("shifted") == 5 + draft.length("skip")
        hidden = {rid: draft.requests[rid].hidden for rid in ("skip", "shifted", "dense")}
        assert torch.allclose(hidden["skip"], hidden["shifted"], atol=1e-4)
        assert not torch.allclose(hidden["skip"], hidden["dense"], atol=1e-3)
        trees = draft.propose(["skip", "shifted"])
        assert trees[0] == trees[1]
    finally:
        for rid in ("skip", "shifted", "dense"):
            draft.release(rid)
    assert draft.kv.num_free_pages == draft.kv.num_total_pages


class PlainLeads(SpeculationPolicy):
    """Plain decoding leads; speculation comes back now and then (as a re-measurement would)."""

    def choose(self, batch_size: int) -> int:
        self.since[0] = self.since.get(0, 0) + 1
        return FULL if self.since[0] % 5 == 0 else 0

    def plain_leads(self, batch_size: int) -> bool:
        return bool(self.since)  # once it has chosen (measured) at all


class Recording:
    """The target, recording the keyword arguments of each verify call and the feature rows each prefill asks."""

    def __init__(self, target):
        self._target, self.calls, self.prompt_rows = target, [], []

    def __getattr__(self, name):
        return getattr(self._target, name)

    def prefill(self, inputs):
        self.prompt_rows += [inp.feature_rows for inp in inputs]
        return self._target.prefill(inputs)

    def verify(self, inputs, **kwargs):
        self.calls.append(kwargs)
        return self._target.verify(inputs, **kwargs)


@pytest.mark.parametrize("kind", ["draft", "draft-eagle3"])
def test_plain_stretches_skipped_by_the_draft_are_lossless_and_keep_positions_true(kind, dev_prompts,
                                                                                   tiny_tokenizer):
    target, draft = tiny_target(), tiny_draft(kind)
    prompts = [tiny_tokenizer.encode(p)[-60:] for p in dev_prompts[44:48]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (45, 30, 38, 20)]
    plain = Scheduler(target, None, target.max_context, 4)
    recorder = Recording(target)
    # room for 3: the fourth request is admitted while others run, where plain decoding leads
    sched = Scheduler(recorder, draft, target.max_context, 3, feature_layers_for(draft), policy=PlainLeads(),
                      plain_steps=4)
    gaps, most = set(), {"skipped": 0, "held": 0}

    def check(s) -> None:  # target positions = draft positions (cached or skipped) + the catch-up still owed
        for rid, state in s.running.items():
            gaps.add(target.requests[rid].kv_len - draft.length(rid) - len(state.backlog_tokens))
            most["skipped"] = max(most["skipped"], draft.requests[rid].skipped)
            most["held"] = max(most["held"], len(state.backlog_tokens))

    assert drive(plain, prompts, params) == drive(sched, prompts, params, check)
    skipped, held = most["skipped"], most["held"]
    assert len(gaps) == 1 and skipped > 0 and held == 1  # plain calls of 4 tokens leave the draft the last
    assert recorder.prompt_rows == [0, 0, 0, 1]  # the first three came before any measurement: whole prompts
    plain_calls = [kw for kw in recorder.calls if kw.get("plain_steps", 1) > 1]
    spec_calls = [kw for kw in recorder.calls if kw.get("plain_steps", 1) == 1]
    assert plain_calls and all(kw.get("feature_rows") == 1 for kw in plain_calls)
    assert spec_calls and not any(kw.get("feature_rows") for kw in spec_calls)
    assert not draft.requests and draft.kv.num_free_pages == draft.kv.num_total_pages
    assert target.kv.num_free_pages == target.kv.num_total_pages


def test_requests_arriving_together_are_weighed_at_the_batch_they_will_form(dev_prompts, tiny_tokenizer):
    """Four requests queued at once into an idle scheduler join a batch of four: where plain decoding leads at that
    size (and not below it) each brings back its last prompt token's features only, and the tokens stay plain
    decoding's."""
    target, draft = tiny_target(), tiny_draft()
    seen = []

    class PlainFromFour(SpeculationPolicy):
        def choose(self, batch_size: int) -> int:
            return 0

        def plain_leads(self, batch_size: int) -> bool:
            seen.append(batch_size)
            return batch_size >= 4

    prompts = [tiny_tokenizer.encode(p)[-50:] for p in dev_prompts[48:52]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    recorder = Recording(target)
    plain = drive(Scheduler(target, None, target.max_context, 8), prompts, [params] * 4)
    sched = Scheduler(recorder, draft, target.max_context, 8, feature_layers_for(draft), policy=PlainFromFour())
    assert drive(sched, prompts, [params] * 4) == plain
    assert recorder.prompt_rows == [1, 1, 1, 1] and set(seen) == {4}
    assert not draft.requests and target.kv.num_free_pages == target.kv.num_total_pages


def test_a_seeded_sampled_request_brings_its_whole_prompt_even_where_plain_decoding_leads(dev_prompts,
                                                                                          tiny_tokenizer):
    """Its draws depend on its trees, and its trees on the draft's context: the same seed must give the same text
    whatever load it arrived at."""
    target, draft = tiny_target(), tiny_draft()

    class Leads(PlainLeads):
        def plain_leads(self, batch_size: int) -> bool:
            return True

    prompts = [tiny_tokenizer.encode(p)[-40:] for p in dev_prompts[52:54]]
    params = [SamplingParams(max_new_tokens=10, temperature=0.8, seed=11), SamplingParams(max_new_tokens=10)]
    recorder = Recording(target)
    drive(Scheduler(recorder, draft, target.max_context, 4, feature_layers_for(draft), policy=Leads()), prompts,
          params)
    assert recorder.prompt_rows == [0, 1]  # the seeded one whole; the greedy one its last token's
    assert not draft.requests and target.kv.num_free_pages == target.kv.num_total_pages


def test_a_feature_budget_shares_the_prompts_features_among_the_requests_admitted_together(dev_prompts,
                                                                                          tiny_tokenizer):
    """With `prompt_feature_rows`, each of a wave of prompts brings the features of its last budget / wave tokens
    (at least MIN_PROMPT_FEATURE_ROWS), a shorter prompt all of its own, a request admitted alone later a bigger
    share; the draft skips the rest, and the tokens stay plain decoding's."""
    from specdec.engine.admission import MIN_PROMPT_FEATURE_ROWS

    target, draft = tiny_target(), tiny_draft()
    tokens = [tiny_tokenizer.encode("\n\n".join(dev_prompts[54 + 4 * i : 58 + 4 * i])) for i in range(4)]  # long
    prompts = [tokens[0][-150:], tokens[1][-150:], tokens[2][-40:], tokens[3][-150:]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (24, 30, 20, 12)]
    plain = drive(Scheduler(target, None, target.max_context, 4), prompts, params)
    recorder = Recording(target)
    # room for 3: the first three are admitted together (a budget of 100 rows each), the fourth alone (300 rows)
    sched = Scheduler(recorder, draft, target.max_context, 3, feature_layers_for(draft),
                      prompt_feature_rows=300)
    skipped = {}

    def check(s) -> None:
        for rid in s.running:
            skipped[rid] = draft.requests[rid].skipped

    assert drive(sched, prompts, params, check) == plain
    assert recorder.prompt_rows == [100, 100, 0, 0]  # the 40-token prompt and the lone 150-token one: whole
    assert skipped == {"r0": 50, "r1": 50, "r2": 0, "r3": 0}
    assert not draft.requests and draft.kv.num_free_pages == draft.kv.num_total_pages
    assert target.kv.num_free_pages == target.kv.num_total_pages
    wide = Scheduler(target, draft, target.max_context, 64, prompt_feature_rows=1)
    assert wide._window(64) == MIN_PROMPT_FEATURE_ROWS and wide._window(1) == MIN_PROMPT_FEATURE_ROWS
    assert Scheduler(target, draft, target.max_context, 4)._window(4) == 0  # no budget: whole prompts
