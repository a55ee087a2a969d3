"""Adaptive speculation: the policy follows measured throughput, and switching modes mid-request stays lossless."""

from __future__ import annotations

from core_engines import tiny_draft, tiny_target

from specdec.engine.adaptive import SpeculationPolicy
from specdec.engine.generate import feature_layers_for
from specdec.engine.requests import RUNNING
from specdec.engine.scheduler import Scheduler
from specdec.sampling_params import SamplingParams


def test_policy_measures_both_modes_then_follows_the_faster_and_keeps_exploring():
    p = SpeculationPolicy(explore_every=8, min_samples=2)
    seen = []
    for i in range(4):  # each mode is tried min_samples times first; its first (warm-up) sample is discarded
        mode = p.choose(4)
        seen.append(mode)
        p.record(4, mode, tokens=(40 if mode else 10) if i % 2 else 1, seconds=1.0)
    assert sorted(seen) == [False, False, True, True]
    later = [p.choose(4) for _ in range(16)]
    assert later.count(True) == 14 and later.count(False) == 2  # speculation wins; plain re-measured 1 in 8
    for _ in range(10):  # acceptance collapses: plain becomes faster at this batch size
        p.record(4, True, tokens=5, seconds=1.0)
    assert [p.choose(4) for _ in range(7)].count(False) >= 6
    assert p.bucket(3) == 4 and p.bucket(4) == 4 and p.bucket(5) == 8 and p.bucket(1) == 1


class AlternatingPolicy(SpeculationPolicy):
    """Switches mode every step, so plain steps leave backlogs the draft must catch up on."""

    def choose(self, batch_size: int) -> bool:
        self.steps[0] = self.steps.get(0, 0) + 1
        return self.steps[0] % 3 != 0  # spec, spec, plain, ...


def _run(scheduler: Scheduler, prompts, params) -> dict[str, list[int]]:
    out = {f"r{i}": [] for i in range(len(prompts))}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        scheduler.add(f"r{i}", prompt, p)
    while scheduler.has_work:
        for ev in scheduler.step():
            assert ev.error is None
            out[ev.request_id] += ev.tokens
    return out


def test_switching_modes_mid_request_is_lossless(dev_prompts, tiny_tokenizer):
    target = tiny_target()
    prompts = [tiny_tokenizer.encode(p)[-100:] for p in dev_prompts[40:44]]
    params = [SamplingParams(max_new_tokens=n) for n in (30, 17, 41, 25)]
    plain = _run(Scheduler(target, None, target.max_context, 4), prompts, params)
    for kind in ("draft", "draft-eagle3"):
        draft = tiny_draft(kind)
        sched = Scheduler(target, draft, target.max_context, 4, feature_layers_for(draft), policy=AlternatingPolicy())
        assert _run(sched, prompts, params) == plain
        assert not draft.requests and draft.kv.num_free_pages == draft.kv.num_total_pages
        assert target.kv.num_free_pages == target.kv.num_total_pages


def test_seeded_sampling_stays_speculative_under_the_policy():
    target, draft = tiny_target(), tiny_draft()
    policy = SpeculationPolicy()
    for _ in range(5):
        policy.record(1, True, 1, 1.0)
        policy.record(1, False, 100, 1.0)  # plain looks far better
    sched = Scheduler(target, draft, target.max_context, 1, policy=policy)
    sched.add("s", [331, 288, 798], SamplingParams(temperature=0.8, seed=3, max_new_tokens=12))
    steps = 0
    while sched.has_work:
        events = sched.step()
        steps += any(e.from_verify for e in events)
        assert all(e.finish_reason in (RUNNING, "stop", "length") for e in events)
    assert draft.kv.num_free_pages == draft.kv.num_total_pages
    assert steps < 12  # speculative steps committed several tokens each


def test_policy_backs_off_re_measuring_while_the_choice_holds_and_resets_when_it_flips():
    p = SpeculationPolicy(explore_every=4, max_explore_every=16, min_samples=2)
    for _i in range(4):  # warm-up: speculation 30 tok/s, plain 10 tok/s
        mode = p.choose(1)
        p.record(1, mode, tokens=30 if mode else 10, seconds=1.0)
    explores = []
    for step in range(60):
        mode = p.choose(1)
        if not mode:
            explores.append(step)
        p.record(1, mode, tokens=30 if mode else 10, seconds=1.0)
    gaps = [b - a for a, b in zip(explores, explores[1:], strict=False)]
    assert gaps[:3] == [8, 16, 16], explores  # 4 -> 8 -> 16 (capped)
    # the next re-measurement finds plain much faster: the choice flips and the interval starts over
    while p.choose(1):
        p.record(1, True, tokens=30, seconds=1.0)
    p.record(1, False, tokens=100, seconds=1.0)
    assert p.intervals[1] == 4
    assert [p.choose(1) for _ in range(3)] == [False, False, False]
