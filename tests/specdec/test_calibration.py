"""`--speculation auto` from a cold start: chains' steps tell the smaller budgets' yields, and the draft's start-up
calibration measures each budget's time at batch 1, so a fresh service's first request speculates."""

from __future__ import annotations

import logging

import pytest
from core_engines import drive, tiny_draft, tiny_target

from specdec.engine.adaptive import FULL, SpeculationPolicy, budget_menu
from specdec.engine.calibration import batch_sizes_up_to, calibrate
from specdec.engine.generate import feature_layers_for
from specdec.engine.scheduler import Scheduler
from specdec.errors import SpecdecError
from specdec.sampling_params import SamplingParams


class _Fixed(SpeculationPolicy):
    """Always `budget`; keeps what the scheduler records."""

    def __init__(self, budget: int):
        super().__init__(budgets=budget_menu(5))
        self.budget, self.records = budget, []

    def choose(self, batch_size: int) -> int:
        return self.budget

    def record(self, batch_size, budget, tokens, seconds, steps=1, yielding=None, chosen_at=None, derived=None):
        self.records.append((budget, tokens, yielding, derived))


def test_a_chain_step_tells_what_the_half_chain_would_have_committed(dev_prompts, tiny_tokenizer):
    """Greedy, same state: the whole chain's first step's derived yield for 2 drafts equals what a step of 2
    drafts commits."""
    target = tiny_target()
    prompts = [tiny_tokenizer.encode(p)[-90:] for p in dev_prompts[0:8]]
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True)] * len(prompts)
    first = {}
    for budget in (FULL, 2):
        draft = tiny_draft()
        policy = _Fixed(budget)
        sched = Scheduler(target, draft, target.max_context, len(prompts), feature_layers_for(draft), policy=policy)
        assert policy.derives_yields  # a chain draft
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            sched.add(f"r{i}", prompt, p)
        while not policy.records:
            sched.step()
        first[budget] = policy.records[0]
        for i in range(len(prompts)):
            sched.abort(f"r{i}")
        while sched.has_work:
            sched.step()
    full_budget, full_tokens, full_yielding, derived = first[FULL]
    half_budget, half_tokens, half_yielding, half_derived = first[2]
    assert full_yielding == half_yielding == len(prompts)
    assert derived == {2: half_tokens}, (derived, half_tokens)
    assert full_tokens >= half_tokens
    assert half_derived == {}  # nothing smaller than 2 in the menu


def test_derived_yields_count_toward_the_smaller_budget():
    p = SpeculationPolicy(budget_menu(5), min_samples=2, min_request_steps=4)
    p.derives_yields = True
    for _ in range(4):
        p.record(1, FULL, tokens=5, seconds=0.010, derived={2: 3})
    assert p.tokens[(1, 2)] == pytest.approx(3.0) and p.counted[(1, 2)] == 4
    assert (1, 2) not in p.seconds  # its time is its own to measure


def test_seeded_times_let_the_first_request_speculate_and_decide_after_the_whole_chain_alone():
    p = SpeculationPolicy(budget_menu(5))
    p.derives_yields = True
    for budget, seconds in ((0, 0.010), (2, 0.012), (FULL, 0.013)):
        p.seed(1, budget, seconds)
    chosen = []
    for _ in range(p.min_request_steps + 2):
        b = p.choose(1)
        chosen.append(b)
        assert b == FULL  # plain is measured outright (1 token a step); half's yield comes from the chain's steps
        p.record(1, b, tokens=4, seconds=0.013, derived={2: 3})
    assert p._is_measured(1, 0) and p._is_measured(1, 2) and p._is_measured(1, FULL)
    assert p.rates[(1, 0)] == pytest.approx(100.0) and p.rates[(1, 2)] == pytest.approx(250.0)
    assert p._best(1) == FULL


def test_seeded_times_where_plain_is_faster_end_speculating_after_the_chain_is_measured():
    p = SpeculationPolicy(budget_menu(5))
    p.derives_yields = True
    for budget, seconds in ((0, 0.001), (2, 0.012), (FULL, 0.013)):
        p.seed(1, budget, seconds)
    for _ in range(p.min_request_steps):
        b = p.choose(1)
        assert b == FULL
        p.record(1, b, tokens=4, seconds=0.013, derived={2: 3})
    assert p.choose(1) == 0  # 1000 tok/s plain against ~300


def test_without_derived_yields_the_menu_is_measured_in_order():
    p = SpeculationPolicy(budget_menu(5))
    for budget, seconds in ((0, 0.010), (2, 0.012), (FULL, 0.013)):
        p.seed(1, budget, seconds)
    assert p.choose(1) == 2  # trees: half's yield is its own


def _idle(sched, target, draft, pages_before) -> None:
    assert not sched.running and not sched.waiting and not sched.has_work
    assert not target.requests and not draft.requests
    assert target.kv.num_free_pages == pages_before


def test_calibration_seeds_every_budget_and_leaves_the_scheduler_as_it_was(dev_prompts, tiny_tokenizer, caplog):
    target, draft = tiny_target(), tiny_draft()
    policy = SpeculationPolicy(budget_menu(draft.spec.num_draft_tokens))
    sched = Scheduler(target, draft, target.max_context, 4, feature_layers_for(draft), policy=policy)
    policy.max_step_tokens = 0  # (no yield ceiling: see test_calibration_at_several_batch_sizes_seeds_each_bucket)
    free = target.kv.num_free_pages
    with caplog.at_level(logging.INFO, logger="specdec.engine.calibration"):
        measured = calibrate(sched, policy, target.model.cfg.vocab_size, max_seconds=120)  # (a loaded machine)
    assert set(measured) == {0, 2, FULL} and all(s > 0 for s in measured.values())
    assert "speculation calibration in " in caplog.text and "at batch 1: plain" in caplog.text
    _idle(sched, target, draft, free)
    assert sched.policy is policy and sched.timings.spec_steps == 0 and sched.timings.plain_steps == 0
    assert all(policy.seconds[(1, b)] == measured[b] for b in measured)
    assert policy.history is None or not policy.history
    assert policy.choose(1) == FULL  # the first real request starts on the whole chain
    # and the scheduler then generates exactly the target's greedy output
    prompts = [tiny_tokenizer.encode(p)[-80:] for p in dev_prompts[20:23]]
    params = [SamplingParams(max_new_tokens=30)] * len(prompts)
    plain = drive(Scheduler(target, None, target.max_context, 4), prompts, params)
    assert drive(sched, prompts, params) == plain
    _idle(sched, target, draft, free)


class _Failing:
    """A target whose verifies fail (an answer the draft cannot use)."""

    def __init__(self, target):
        self.inner = target

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify(self, *args, **kwargs):
        raise SpecdecError("malformed reply")


def test_a_failing_calibration_is_logged_and_the_policy_learns_as_before(caplog):
    target, draft = tiny_target(), tiny_draft()
    free = target.kv.num_free_pages
    policy = SpeculationPolicy(budget_menu(draft.spec.num_draft_tokens))
    sched = Scheduler(_Failing(target), draft, target.max_context, 4, feature_layers_for(draft), policy=policy)
    with caplog.at_level(logging.WARNING, logger="specdec.engine.calibration"):
        assert calibrate(sched, policy, target.model.cfg.vocab_size) == {}
    assert "calibration stopped" in caplog.text
    assert not policy.seconds and sched.policy is policy
    _idle(sched, target, draft, free)  # the throw-away request released on both sides


def test_calibration_at_several_batch_sizes_seeds_each_bucket(caplog):
    """`batch_sizes` (the draft's --calibration-max-batch): each bucket's plain decoding is measured outright and its
    speculative budgets timed, so a bucket's first real requests start on the whole chain instead of three plain
    calls (on a GPU 48 of a 128-token request's tokens); everything is released afterwards."""
    target, draft = tiny_target(), tiny_draft()
    policy = SpeculationPolicy(budget_menu(draft.spec.num_draft_tokens))
    sched = Scheduler(target, draft, target.max_context, 4, feature_layers_for(draft), policy=policy)
    policy.max_step_tokens = 0  # no yield ceiling: stalls on a loaded CPU can put a chain's time out of its reach
    # (`test_a_budget_that_could_not_win_at_any_acceptance_is_not_measured_on_requests`)
    free = target.kv.num_free_pages
    with caplog.at_level(logging.INFO, logger="specdec.engine.calibration"):
        measured = calibrate(sched, policy, target.model.cfg.vocab_size, max_seconds=120,
                             batch_sizes=batch_sizes_up_to(4))
    assert set(measured) == {0, 2, FULL}  # (batch 1's, as before)
    for n in (1, 2, 4):
        assert all(policy.samples[(n, b)] >= policy.min_samples for b in (0, 2, FULL)), n
        assert policy._is_measured(n, 0) and not policy._is_measured(n, FULL)  # a chain's yield: from requests
        assert policy.choose(n) == FULL
    assert (8, 0) not in policy.seconds  # (the scheduler's max batch size is 4)
    assert "at batch 1: plain" in caplog.text and "; at batch 4: plain" in caplog.text
    _idle(sched, target, draft, free)
    assert sched.max_queue_wait_s == 0.0 and sched.policy is policy


def test_a_batch_size_the_pools_cannot_hold_ends_calibration_without_waiting(caplog):
    """The KV pools take the throw-away requests only at once (no wait for pages): the first batch size they cannot
    hold ends calibration, with what was measured before it kept and nothing left behind."""
    import time

    from repo_paths import TINY

    from specdec.engine.factory import EngineOptions, build_target

    target = build_target(str(TINY / "target"), EngineOptions(num_pages=64, max_batch_size=16))
    draft = tiny_draft()
    policy = SpeculationPolicy(budget_menu(draft.spec.num_draft_tokens))
    sched = Scheduler(target, draft, target.max_context, 16, feature_layers_for(draft), policy=policy,
                      max_queue_wait_s=30.0)
    handed = []
    sched.before_decode = handed.extend  # as the service's engine loop takes admission events (QA: a batch size
    # taken in part was timed at the part, its refusals handed to streams that did not exist)
    free = target.kv.num_free_pages
    t0 = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="specdec.engine.calibration"):
        calibrate(sched, policy, target.model.cfg.vocab_size, max_seconds=120, batch_sizes=batch_sizes_up_to(16))
    assert time.perf_counter() - t0 < 25  # (a wait for pages would have taken its 30 s)
    assert "calibration stopped" in caplog.text and "KV" in caplog.text
    assert "stopped at 4 throw-away requests at once (KV pool full" in caplog.text  # 2 of 4 fit: no seeds at 4
    assert policy._is_measured(1, 0) and policy._is_measured(2, 0) and (4, 0) not in policy.seconds
    assert sched.max_queue_wait_s == 30.0 and sched.before_decode == handed.extend and not handed
    _idle(sched, target, draft, free)


class _StallingOnce:
    """A target whose `nth` verify of a batch of `size` requests stalls `seconds` first (a shared CPU)."""

    def __init__(self, target, size: int, nth: int, seconds: float):
        self.inner, self.size, self.nth, self.seconds, self.seen = target, size, nth, seconds, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def verify(self, inputs, *args, **kwargs):
        import time

        if len(inputs) == self.size:
            self.seen += 1
            if self.seen == self.nth:
                time.sleep(self.seconds)
        return self.inner.verify(inputs, *args, **kwargs)


def test_a_stall_in_a_batch_sizes_few_calibration_steps_does_not_set_its_time():
    """Above batch 1 each budget runs only a few steps (start-up time), and its time is their median: one 0.2 s
    stall among them (a plain call of 2 requests is ~25 ms) left batch 2's plain decoding slower per request-step
    than batch 1's when averaged (QA-like runs beside a busy CPU: 10.5 ms against 3.6). Here a 1 s stall, which
    averaged into 5 samples of 4-step calls would add 25 ms a request-step; batch 2's time stays within 3x batch 1's
    (it is about 0.6x on an idle CPU, and read 1.5-1.8x under a load of 4-5 on 2 cores, where comparing against 1x
    failed 2 runs of 4: QA)."""
    target, draft = tiny_target(), tiny_draft()
    policy = SpeculationPolicy(budget_menu(draft.spec.num_draft_tokens))
    stalling = _StallingOnce(target, size=2, nth=3, seconds=1.0)
    sched = Scheduler(stalling, draft, target.max_context, 2, feature_layers_for(draft), policy=policy)
    calibrate(sched, policy, target.model.cfg.vocab_size, max_seconds=120, batch_sizes=(1, 2))
    assert stalling.seen >= 3  # the stall happened, in plain decoding's steps at batch 2
    assert policy.seconds[(2, 0)] < 3 * policy.seconds[(1, 0)]


def test_a_calibrated_bucket_borrows_the_nearest_measured_yield_and_chooses_at_once():
    """Every bucket's times calibrated (a GPU's start-up), the chain's yield measured at batch 1 only: at 32 requests
    plain decoding's calibrated rate beats the chain's with that yield, so the bucket follows plain from its first
    call (and admission skips the prompt features the draft would not use) instead of running the whole chain until
    its own requests measured it; at 8 the chain wins at once. With no yield measured anywhere, the chain runs
    first as before."""

    def calibrated() -> SpeculationPolicy:
        p = SpeculationPolicy(budget_menu(5), min_samples=3)
        p.derives_yields = True
        for n, times in {1: (0.005, 0.006, 0.007), 8: (0.0006, 0.0009, 0.001), 32: (0.00016, 0.0005, 0.0012)}.items():
            for budget, seconds in zip((0, 2, FULL), times, strict=True):
                p.seed(n, budget, seconds)
        return p

    cold = calibrated()
    assert not cold.plain_leads(32) and cold.choose(32) == FULL  # nothing to borrow: its own steps measure it
    p = calibrated()
    for _ in range(p.min_request_steps):  # batch 1 measures the chain: 5 tokens a step, 3 for the half chain
        p.record(1, p.choose(1), tokens=5, seconds=0.007, derived={2: 3})
    assert p.tokens[(1, FULL)] == pytest.approx(5.0) and p.tokens[(1, 2)] == pytest.approx(3.0)
    assert p.plain_leads(32) and p.choose(32) == 0  # plain 6250 tok/s, half 6000, whole 4167
    assert p.rates[(32, FULL)] == pytest.approx(5 / 0.0012)
    assert p.choose(8) == FULL  # 5000 tok/s against plain's 1667
    p.record(32, 0, tokens=32 * 16, seconds=0.082, steps=16)  # its own steps take over from the borrowed yield
    for _ in range(3):
        p.record(32, FULL, tokens=32 * 2, seconds=32 * 0.0012, derived={2: 32 * 2})
    assert p.tokens[(32, FULL)] < 2.5


def test_a_budget_that_could_not_win_at_any_acceptance_is_not_measured_on_requests():
    """A speculative budget whose calibrated time loses to plain decoding even with every draft accepted (a chain of
    5: 6 tokens a step at most) counts as measured: a fresh draft follows plain decoding from its first step. On a
    GPU the tiny pair's whole-chain step took ~5 ms against 0.42 ms a plain token, and the policy ran 16 whole-chain
    steps of the first request to learn its yield (0.54-0.65x of Generate, H200). A budget that could win is still
    measured on the requests; its own steps replace the ceiling."""

    def calibrated(full_s: float, half_s: float = 0.004) -> SpeculationPolicy:
        p = SpeculationPolicy(budget_menu(5), min_samples=3)
        p.derives_yields, p.max_step_tokens = True, 6
        for budget, seconds in ((0, 0.00042), (2, half_s), (FULL, full_s)):
            p.seed(1, budget, seconds)
        return p

    p = calibrated(0.005)
    assert p.plain_leads(1) and p.choose(1) == 0
    assert p.rates[(1, FULL)] == pytest.approx(6 / 0.005) and p.rates[(1, 2)] == pytest.approx(3 / 0.004)
    assert [p.choose(1) for _ in range(8)] == [0] * 8
    p.record(1, FULL, tokens=2, seconds=0.005)  # a re-measurement: its own yield, never above the ceiling
    assert p.tokens[(1, FULL)] == 2 and p.choose(1) == 0
    fast = calibrated(0.002, 0.0015)  # 3000 tok/s at 6 tokens a step could beat plain's 2381 (the half chain's
    # 3 tokens, 2000, could not): the whole chain's yield is measured, and with it the half chain's
    assert not fast.plain_leads(1) and fast.choose(1) == FULL
    unknown = calibrated(0.005)
    unknown.max_step_tokens = 0  # the depth not known: measured as before
    assert unknown.choose(1) == FULL


def test_a_stop_during_calibration_ends_it_and_releases_its_requests(caplog):
    """`should_stop` (the engine loop stopping: a SIGTERM during start-up) is asked between steps: calibration
    returns at once with its throw-away requests released on the target (a stopped draft's requests held a
    target's pages until its idle release, 120 s later, QA)."""
    target, draft = tiny_target(), tiny_draft()
    policy = SpeculationPolicy(budget_menu(draft.spec.num_draft_tokens))
    sched = Scheduler(target, draft, target.max_context, 8, feature_layers_for(draft), policy=policy)
    free = target.kv.num_free_pages
    steps = []
    real_step = sched.step
    sched.step = lambda: (steps.append(len(target.requests)), real_step())[1]
    with caplog.at_level(logging.INFO, logger="specdec.engine.calibration"):
        calibrate(sched, policy, target.model.cfg.vocab_size, max_seconds=120, batch_sizes=(1, 2, 4, 8),
                  should_stop=lambda: len(steps) >= 3)
    assert "calibration stopped: the service is stopping" in caplog.text
    assert len(steps) <= 3 + 16 and not policy.seconds  # no budget finished timing
    assert target.kv.num_unreserved_pages == target.kv.num_total_pages
    _idle(sched, target, draft, free)
