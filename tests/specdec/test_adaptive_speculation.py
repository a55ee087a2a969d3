"""Adaptive speculation: the policy follows measured throughput, and switching modes mid-request stays lossless."""

from __future__ import annotations

from core_engines import drive, tiny_draft, tiny_target

from specdec.engine.adaptive import FULL, SpeculationPolicy, budget_menu
from specdec.engine.generate import feature_layers_for
from specdec.engine.requests import RUNNING
from specdec.engine.scheduler import Scheduler
from specdec.sampling_params import SamplingParams


def test_policy_measures_both_modes_then_follows_the_faster_and_keeps_exploring():
    # (explore_cost=0: the schedule in choices alone; a far rival's cost in time is tested below)
    p = SpeculationPolicy(explore_every=8, max_explore_every=8, min_samples=2, min_request_steps=1, explore_cost=0)
    seen = []
    for i in range(4):  # each budget is tried min_samples times first; its first (warm-up) sample is discarded
        mode = p.choose(4)
        seen.append(mode)
        p.record(4, mode, tokens=(40 if mode else 10) if i % 2 else 1, seconds=1.0)
    assert sorted(seen) == sorted([0, 0, FULL, FULL])
    later = []
    for _ in range(16):
        later.append(p.choose(4))
        p.record(4, later[-1], tokens=40 if later[-1] else 10, seconds=1.0)
    # speculation wins; plain re-measured every 8 choices, until it has a steady sample (the first landing after a
    # switch only warms up)
    assert later == [FULL] * 7 + [0, 0] + [FULL] * 7
    for _ in range(40):  # acceptance collapses: plain becomes faster at this batch size
        p.record(4, FULL, tokens=5, seconds=1.0)
    after = []
    for _ in range(7):
        after.append(p.choose(4))
        p.record(4, after[-1], tokens=5 if after[-1] else 10, seconds=1.0)
    assert after.count(0) >= 5  # (a re-measurement of the tree falls due in them)
    assert p.bucket(3) == 4 and p.bucket(4) == 4 and p.bucket(5) == 8 and p.bucket(1) == 1


def test_a_re_measurement_lasts_until_it_has_a_steady_sample():
    """A rival's landings that are not sampled (a request's end, an admission beside it) do not end its
    re-measurement: it goes on until one steady sample came back, at most `probe_choices` choices."""
    p = SpeculationPolicy(explore_every=4, max_explore_every=4, min_samples=2, min_request_steps=1, explore_cost=0)
    for mode in (0, 0, FULL, FULL):
        assert p.choose(1) == mode
        p.record(1, mode, tokens=4 if mode else 1, seconds=0.01)
    chosen = [p.choose(1) for _ in range(4)]
    assert chosen == [FULL, FULL, FULL, 0]  # the re-measurement of plain decoding is due
    p.record(1, 0, tokens=1, seconds=0.01)  # its first landing warms up
    assert [p.choose(1) for _ in range(3)] == [0, 0, 0]  # no landing sampled yet: it goes on, up to 4 choices
    assert p.choose(1) == FULL
    p = SpeculationPolicy(explore_every=4, max_explore_every=4, min_samples=2, min_request_steps=1, explore_cost=0)
    for mode in (0, 0, FULL, FULL):
        p.choose(1)
        p.record(1, mode, tokens=4 if mode else 1, seconds=0.01)
    [p.choose(1) for _ in range(3)]
    assert p.choose(1) == 0
    p.record(1, 0, tokens=1, seconds=0.01)  # warm-up
    assert p.choose(1) == 0
    p.record(1, 0, tokens=1, seconds=0.01)  # steady: the re-measurement is over
    assert p.choose(1) == FULL


def test_a_clipped_sample_is_given_back_to_the_short_one_after_it():
    """Pipelined landings in pairs (the draft behind: the second call done while the first landed) average to the
    real pace; a one-off stall followed by normal steps stays clipped."""
    p = SpeculationPolicy(budgets=(0,), min_samples=1)
    for _ in range(8):
        p.record(1, 0, tokens=1, seconds=0.010)
    for _ in range(40):  # the same calls now land as 38 ms + 2 ms pairs: 20 ms a call
        p.record(1, 0, tokens=1, seconds=0.038)
        p.record(1, 0, tokens=1, seconds=0.002)
    assert 0.8 < p.rates[(1, 0)] / 50.0 < 1.25  # (clipped alone: ~2x the real rate)
    q = SpeculationPolicy(budgets=(0,), min_samples=1)
    for i in range(30):
        q.record(1, 0, tokens=1, seconds=0.2 if i == 20 else 0.010)
    assert abs(q.rates[(1, 0)] - 100.0) < 5.0


def test_budget_menu_and_a_middle_budget_that_wins():
    assert budget_menu(5) == (0, 2, FULL) and budget_menu(16) == (0, 8, FULL) and budget_menu(3) == (0, FULL)
    p = SpeculationPolicy(budgets=budget_menu(8), explore_every=6, min_samples=2, explore_cost=0)
    speed = {0: 10, 4: 25, FULL: 18}  # at this batch size half the chain beats both extremes
    chosen = []
    for _ in range(40):
        b = p.choose(16)
        chosen.append(b)
        p.record(16, b, tokens=speed[b], seconds=1.0)
    tail = chosen[10:]
    assert tail.count(4) >= len(tail) - 4  # the winner, with the other two re-measured in turn
    assert {0, FULL} <= set(tail)
    assert p.summary()["bs16-d4"] == 25.0


class AlternatingPolicy(SpeculationPolicy):
    """Switches budget every step: plain steps leave backlogs the draft must catch up on, small budgets cut trees."""

    def choose(self, batch_size: int) -> int:
        self.since[0] = self.since.get(0, 0) + 1
        return (FULL, 2, 0)[self.since[0] % 3]  # whole tree, 2 nodes, plain, ...


def test_switching_modes_mid_request_is_lossless(dev_prompts, tiny_tokenizer):
    target = tiny_target()
    prompts = [tiny_tokenizer.encode(p)[-100:] for p in dev_prompts[40:44]]
    params = [SamplingParams(max_new_tokens=n) for n in (30, 17, 41, 25)]
    plain = drive(Scheduler(target, None, target.max_context, 4), prompts, params)
    for kind in ("draft", "draft-eagle3"):
        draft = tiny_draft(kind)
        sched = Scheduler(target, draft, target.max_context, 4, feature_layers_for(draft), policy=AlternatingPolicy())
        assert drive(sched, prompts, params) == plain
        assert not draft.requests and draft.kv.num_free_pages == draft.kv.num_total_pages
        assert target.kv.num_free_pages == target.kv.num_total_pages


def test_seeded_sampling_stays_speculative_under_the_policy():
    target, draft = tiny_target(), tiny_draft()
    policy = SpeculationPolicy()
    for _ in range(5):
        policy.record(1, FULL, 1, 1.0)
        policy.record(1, 0, 100, 1.0)  # plain looks far better
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
    p = SpeculationPolicy(explore_every=4, max_explore_every=16, min_samples=2, min_request_steps=8)
    for _i in range(4):  # warm-up: speculation 30 tok/s, plain 20 tok/s (within half: re-measured from 4 steps up)
        mode = p.choose(1)
        p.record(1, mode, tokens=30 if mode else 20, seconds=1.0)
    explores = []
    for step in range(60):
        mode = p.choose(1)
        if mode == 0:
            explores.append(step)
        p.record(1, mode, tokens=30 if mode else 20, seconds=1.0)
    starts = [x for i, x in enumerate(explores) if not i or explores[i - 1] != x - 1]
    assert all(x + 1 in explores for x in starts)  # each re-measurement runs plain twice (a warm-up, a measure)
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert gaps[:3] == [9, 17, 17], explores  # 4 -> 8 -> 16 (capped) choices, plus the re-measurement's second
    # plain steps turn 10x faster: the re-measurements pull plain's average up until the choice flips, and the
    # interval starts over
    for _ in range(100):
        mode = p.choose(1)
        p.record(1, mode, tokens=30 if mode else 20, seconds=1.0 if mode else 0.1)
        if p._best(1) == 0:
            break
    assert p._best(1) == 0 and p.intervals[1] == 4
    assert [p.choose(1) for _ in range(3)] == [0, 0, 0]


def test_rivals_far_behind_are_re_measured_at_the_longest_interval():
    """Where every rival measured under half the choice's rate (the tiny pair at batch 1 on a GPU: the half chain at a
    quarter of plain decoding's rate, its re-measurements ~20% of a 128-token run), they are re-measured every
    `max_explore_every` steps instead of backing off from `explore_every`; still re-measured, and followed once
    they lead. (explore_cost=0: here every call takes the same time; a far rival's cost in time is tested below.)"""
    p = SpeculationPolicy(explore_every=4, max_explore_every=16, min_samples=2, min_request_steps=8, explore_cost=0)
    speed = {0: 100.0, FULL: 20.0}
    chosen = _drive(p, 1, speed, steps=90)
    full = [i for i, b in enumerate(chosen) if b == FULL]
    starts = [x for i, x in enumerate(full) if not i or full[i - 1] != x - 1][1:]  # after its first measurement
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert len(starts) >= 3 and set(gaps) == {17}, chosen  # 16 choices, plus the re-measurement's second
    speed[FULL] = 400.0  # speculation turns 20x faster: the next re-measurements find it
    assert _drive(p, 1, speed, steps=60)[-5:] == [FULL] * 5


def test_near_ties_do_not_flip_the_choice_but_a_clear_lead_does():
    """Plain and the whole tree equally fast, each step's time jittering +-3%: once settled, the budget the policy
    follows stays put (without the switch margin it changed 13-20 times in these 300 steps) and re-measurements
    back off to the cap; when the rival pulls 10% ahead, the policy switches to it."""
    import random

    for seed in range(3):
        rng = random.Random(seed)
        p = SpeculationPolicy(explore_every=4, max_explore_every=32, min_samples=2, min_request_steps=1)
        rate = {0: 100.0, FULL: 100.0}
        followed = []
        for _ in range(400):
            mode = p.choose(8)
            followed.append(p.followed.get(8))
            p.record(8, mode, tokens=8 * rate[mode] * 0.01, seconds=0.01 * rng.uniform(0.97, 1.03))
        settled = followed[100:]
        assert sum(a != b for a, b in zip(settled, settled[1:], strict=False)) <= 1 and p.intervals[8] == 32
        other = FULL if settled[-1] == 0 else 0
        rate[other] *= 1.10
        for _ in range(200):
            mode = p.choose(8)
            p.record(8, mode, tokens=8 * rate[mode] * 0.01, seconds=0.01)
        assert p.followed[8] == other


def test_plain_decoding_takes_over_from_speculation_at_a_smaller_lead():
    """Whole tree followed, plain decoding measured 2% faster at a re-measurement: the policy turns to plain (the
    switch margin for it is 1%, not 3%); the whole tree 2% ahead of plain again does not bring it back."""
    p = SpeculationPolicy(explore_every=4, max_explore_every=4, min_samples=2, min_request_steps=1)
    rate = {0: 100.0, FULL: 120.0}

    def run(steps):
        for _ in range(steps):
            mode = p.choose(8)
            p.record(8, mode, tokens=8 * rate[mode] * 0.01, seconds=0.01)

    run(30)
    assert p.followed[8] == FULL
    rate[FULL] = 100.0 / 1.02  # plain 2% ahead
    run(60)
    assert p.followed[8] == 0
    rate[FULL] = 102.0  # the tree 2% ahead: within the 3% margin speculation needs
    run(60)
    assert p.followed[8] == 0


def test_noisy_acceptance_averages_out_where_per_step_rates_did_not():
    """Batch 1, chain tokens per step 1-6 (mean 3.15, the tiny pair's), step time fixed: a speculative step is 1.23x
    faster than plain on average (the H200 in-process ratio). The policy's estimate of the chain's rate strays
    under 8% on average after its warm-up, less than half of what a moving average of per-step rates (weight 0.3,
    the previous rule) strays, and the policy follows the chain on most steps."""
    import random

    draws = [1, 1, 2, 3, 4, 5, 6, 3, 4, 2, 4, 3, 3, 3, 5, 1, 6, 2, 2, 3]  # mean 3.15
    plain_rate, spec_rate = 1374.0, 1688.0
    for seed in range(3):
        rng = random.Random(seed)
        p = SpeculationPolicy(budgets=(0, FULL))
        chosen, errors, old_errors, old = [], [], [], None
        for i in range(400):
            mode = p.choose(1)
            chosen.append(mode)
            if mode == 0:
                p.record(1, 0, tokens=4, seconds=4 / plain_rate)
                continue
            tokens = rng.choice(draws)
            p.record(1, FULL, tokens=tokens, seconds=3.15 / spec_rate)
            rate = tokens * spec_rate / 3.15
            old = rate if old is None else 0.7 * old + 0.3 * rate
            if i > 40:
                errors.append(abs(p.rates[(1, FULL)] / spec_rate - 1))
                old_errors.append(abs(old / spec_rate - 1))
        mean, old_mean = sum(errors) / len(errors), sum(old_errors) / len(old_errors)
        assert mean < 0.08 and mean < old_mean / 2 and chosen[40:].count(FULL) >= 300, (seed, mean, old_mean)


def _paths(tree) -> set[tuple[int, ...]]:
    """Each node as the token path from the root to it."""
    paths = []
    for tok, parent in zip(tree.tokens, tree.parents, strict=True):
        paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
    return set(paths)


def test_a_smaller_budget_proposes_the_best_nodes_of_the_same_tree(dev_prompts, tiny_tokenizer):
    from specdec.engine.draft_engine import SpecConfig

    target = tiny_target()
    for spec in (SpecConfig(5, 2, 8), SpecConfig(5, 1, 5)):
        draft = tiny_draft(spec=spec)
        prompt = tiny_tokenizer.encode(dev_prompts[3])[-80:]
        sched = Scheduler(target, draft, target.max_context, 1, feature_layers_for(draft))
        rid = f"budget-{spec.topk}"
        sched.add(rid, prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        events = sched.step()  # admission: prefill + draft extend over the prompt, then one step
        assert rid in draft.requests, events
        full = draft.propose([rid])[0]
        for size in (1, 2, spec.num_draft_tokens // 2):
            small = draft.propose([rid], size)[0]
            assert len(small) == size and all(p < i for i, p in enumerate(small.parents))
            assert _paths(small) <= _paths(full)
        assert draft.propose([rid], 99)[0] == full  # capped at the spec's size
        sched.abort(rid)
        sched.step()
        assert rid not in target.requests


def test_timings_split_admission_plain_and_speculative_steps(dev_prompts, tiny_tokenizer):
    from specdec.engine.generate import generate
    from specdec.engine.requests import StepTimings

    target, draft = tiny_target(), tiny_draft()
    prompts = [tiny_tokenizer.encode(p)[-60:] for p in dev_prompts[60:63]]
    timings = StepTimings(calls=[])
    out = generate(target, draft, prompts, SamplingParams(max_new_tokens=20, ignore_eos=True),
                   policy=AlternatingPolicy(), timings=timings)
    assert all(len(r.tokens) == 20 for r in out)
    assert timings.plain_steps > 0 and timings.spec_steps > 0 and timings.admit_s > 0
    assert timings.plain_s > 0 and timings.spec_s > timings.propose_s > 0
    assert max(r.num_verify_steps for r in out) == timings.plain_steps + timings.spec_steps
    # each landed call: (speculative, requests, target steps, seconds, requests that ended in it)
    calls = timings.calls
    assert sum(c[2] for c in calls if not c[0]) == timings.plain_steps
    assert sum(c[0] for c in calls) == timings.spec_steps
    assert abs(sum(c[3] for c in calls) - timings.plain_s - timings.spec_s) < 1e-3 and sum(c[4] for c in calls) == 3


def _drive(p: SpeculationPolicy, batch_size: int, speed: dict[int, float], steps: int = 60) -> list[int]:
    """The budgets `p` chooses over `steps` steps when budget x delivers speed[x] tokens/s."""
    chosen = []
    for _ in range(steps):
        b = p.choose(batch_size)
        chosen.append(b)
        p.record(batch_size, b, tokens=speed[b], seconds=1.0)
    return chosen


def test_the_whole_tree_is_measured_even_where_half_the_tree_loses_to_plain():
    """Small batch: half the chain pays the whole proposal and gains little, so it loses to plain decoding, yet the
    whole chain wins (measured on the tiny pair at batch 1: plain 87, half 67, whole 96 tokens/s). The policy
    finds it; where the whole tree loses narrowly it is re-measured in turn, at the backed-off interval, and where
    it loses clearly (under `far_rival` of plain's rate) only half the tree, between them, is."""
    p = SpeculationPolicy(budgets=budget_menu(8), explore_every=4, max_explore_every=4, min_samples=2)
    chosen = _drive(p, 1, {0: 87, 4: 67, FULL: 96})
    # every 4 choices a rival runs for two (the first only warms up): the whole chain 3 of every 5 choices
    assert chosen[10:].count(FULL) >= 30 and {0, 4} <= set(chosen[10:])
    chosen = _drive(p, 64, {0: 30, 4: 20, FULL: 26})  # plain wins narrowly
    assert chosen[10:].count(0) >= 30 and 6 <= chosen[10:].count(FULL) <= 12
    chosen = _drive(p, 32, {0: 30, 4: 20, FULL: 18})  # plain wins clearly (8B shape, 128 requests, tau 3: 0.65x)
    assert chosen[10:].count(0) >= 30 and FULL not in chosen[10:] and chosen[10:].count(4) >= 12


def test_where_half_the_tree_loses_badly_the_whole_tree_is_not_probed_until_half_the_tree_wins():
    """Large batch, compute-bound (tiny pair, 16-node trees, batch 128 on an H200: plain 12743, 8 nodes ~1700-5000,
    16 nodes 5412 tok/s): half the tree is under half of plain's rate, so the costlier whole tree is not tried;
    once acceptance rises and half the tree wins, the whole tree is measured next."""
    p = SpeculationPolicy(budgets=budget_menu(8), explore_every=4, max_explore_every=4, min_samples=2)
    chosen = _drive(p, 128, {0: 30, 4: 10, FULL: 8})
    assert FULL not in chosen and chosen[10:].count(0) >= 30  # half the tree re-measured 2 in 5
    later = _drive(p, 128, {0: 30, 4: 45, FULL: 60})  # acceptance rises
    assert FULL in later and later[-20:].count(FULL) >= 12


def test_a_plain_call_that_ends_requests_is_not_read_as_a_low_yield():
    """Seen on the H200 at 128 requests: the last plain call of a batch (72 requests left, most finishing inside
    it) yielded 2.6 tokens per request against 4 per call before; weighted by its 72 requests it pulled plain's
    tokens-per-step average down to 2.7 and plain's rate from 9176 to 5743 tok/s, so `auto` speculated where
    plain decoding was faster. Finished requests are left out of the yield and a call counts per target step."""
    p = SpeculationPolicy(min_samples=2)
    for _ in range(3):
        p.record(128, 0, tokens=512, seconds=0.045, steps=4)
    before = p.rates[(128, 0)]
    assert abs(before - 512 / 0.045) < 1e-6 and abs(p.tokens[(128, 0)] - 1.0) < 1e-12  # per request-step
    p.record(110, 0, tokens=120, seconds=0.041, steps=4, yielding=30)  # 80 requests finished in the call
    assert p.tokens[(128, 0)] == 1.0 and p.rates[(128, 0)] > 0.8 * before  # the time per request-step rose a bit
    p.record(64, 0, tokens=0, seconds=0.03, steps=2, yielding=0)  # every request finished: time only
    assert p.tokens[(128, 0)] == 1.0
    q = SpeculationPolicy()
    q.record(8, 0, tokens=0, seconds=0.01, yielding=0)  # nothing to read a yield from, nothing before: ignored
    assert q.rates == {} and q.samples == {}


def test_every_target_step_is_counted_the_last_of_a_request_too():
    """`speculation_policy_target_steps_total` counts every target step with its budget, a call in which every
    request finished included (QA: at batch 1 each request's last step went uncounted, so the counter lagged the
    draft's own step count)."""
    p = SpeculationPolicy()
    p.record(1, FULL, tokens=5, seconds=0.01)
    p.record(1, FULL, tokens=0, seconds=0.01, yielding=0)  # the request's last step: nothing to read a yield from
    p.record(1, 0, tokens=0, seconds=0.02, steps=4, yielding=0)  # a plain call that ended its requests: 4 steps
    assert p.target_steps == {FULL: 2, 0: 4}
    assert p.samples.get((1, 0), 0) == 0  # time alone, no yield: still not a sample


def test_at_batch_1_a_speculative_budget_is_measured_over_enough_steps_to_average_its_acceptance():
    """At batch 1 a step accepts 1 to 7 tokens: a speculative budget is measured over `min_request_steps`
    request-steps before the policy compares it; plain decoding (one token a step) over `min_samples` steps."""
    p = SpeculationPolicy(min_samples=3, min_request_steps=8)
    chosen = []
    for i in range(40):
        budget = p.choose(1)
        chosen.append(budget)
        p.record(1, budget, tokens=(7, 2, 5, 6, 3)[i % 5] if budget else 1, seconds=0.01)
    first = chosen[:12]  # plain 3 steps, then the chain 9 (the first only warms up)
    assert first == [0] * 3 + [FULL] * 9
    assert p.counted[(1, FULL)] >= 8 and p.choose(1) == FULL
    big = SpeculationPolicy(min_samples=3, min_request_steps=8)
    seen = []
    for _ in range(6):  # at batch 16 a step holds 16 request-steps: three steps of each budget, as before
        seen.append(big.choose(16))
        big.record(16, seen[-1], tokens=40 if seen[-1] else 16, seconds=0.01)
    assert seen == [0, 0, 0, FULL, FULL, FULL] and big._measured(16) == [0, FULL]


def test_a_one_off_stall_moves_a_budgets_time_a_bounded_step():
    """Seen on the H200 at 128 requests: one whole-tree step took 208 ms among 40-45 ms ones; averaged in as is
    it halved the chain's rate until its next re-measurement, dozens of steps later. A step enters the average
    clipped to twice the current estimate: the stall moves it by 30% at most, a lasting change still gets
    through in a few steps."""
    p = SpeculationPolicy(min_samples=2, min_request_steps=1)
    for _ in range(5):  # past the running mean of the first samples
        p.record(128, FULL, tokens=640, seconds=0.040)
    p.record(128, FULL, tokens=640, seconds=0.208)
    assert abs(p.seconds[(128, FULL)] * 128 - 0.040 * 1.3) < 1e-9
    for _ in range(8):  # a real slow-down to 0.2 s a step
        p.record(128, FULL, tokens=640, seconds=0.2)
    assert p.seconds[(128, FULL)] * 128 > 0.18


def test_the_first_landing_after_a_switch_only_warms_up():
    """Seen through the services (8B shape, tau 5, 64 requests, 2 x H200): the first two landings of the whole
    chain after a plain stretch took 24 and 17 ms against 10 ms steady (the draft settles and catches up, the first
    micro-batch's verify has nothing to overlap); averaged in, they pulled its rate under plain decoding's, though
    its steady steps ran at 1.5x. A budget's first landing after another budget's stays out of its averages, and a
    re-measurement runs the rival for two choices, so it still measures one steady landing."""
    p = SpeculationPolicy(explore_every=4, max_explore_every=4, min_samples=2, min_request_steps=1, history=[])
    chosen, last = [], None
    for _ in range(60):
        budget = p.choose(4)
        chosen.append(budget)
        seconds = 1.0 if budget == last or last is None else 3.0  # a switch's first landing: 3x slower
        p.record(4, budget, tokens=15 if budget else 10, seconds=seconds)
        last = budget
    assert p.rates[(4, FULL)] == 15.0 and p.rates[(4, 0)] == 10.0  # the steady rates
    assert chosen[10:].count(FULL) >= 30  # followed; plain re-measured for 2 of every 5 choices
    warm = [h for h in p.history if h[0] == "warm-up"]
    assert warm and all(h[4] == 3.0 for h in warm)  # every slow landing, and only those, was left out
    # after the first measurement (whose first sample is overwritten by the next anyway) every averaged landing
    # was a steady one
    assert all(h[4] == 1.0 for h in p.history[4:] if h[0] == "step")


def test_a_pipelined_call_landing_right_after_the_one_before_it_does_not_set_the_baseline():
    """Seen on the CPU (tiny pair through the services, batch 2): pipelined plain calls landed 224 ms, 2 ms, 143 ms
    and 92 ms after the landing before them (the draft's landing was the bottleneck, so the second call's reply was
    waiting). The 2 ms sample used to become the average, which the 2x clip then held there (plain read 1661
    tok/s where it ran at ~60). The first samples now enter as a running mean."""
    p = SpeculationPolicy(min_samples=3, min_request_steps=1)
    for seconds in (0.224, 0.002, 0.143, 0.092, 0.002, 0.143, 0.002, 0.143):
        p.record(2, 0, tokens=8, seconds=seconds, steps=4)
    true_rate = 2 * 4 / ((0.002 + 0.143) / 2)  # each pair of landings: two calls of 4 steps of 2 requests
    assert 0.6 * true_rate < p.rates[(2, 0)] < 1.6 * true_rate, (p.rates, true_rate)


def test_the_history_holds_each_record_with_its_time_and_each_admission(dev_prompts, tiny_tokenizer):
    """`SpeculationPolicy.history` (the draft service's SPECDEC_POLICY_HISTORY): records in time order with the
    admissions between them, so a diagnosis can tell which intervals an admission shared."""
    target, draft = tiny_target(), tiny_draft()
    policy = SpeculationPolicy(budget_menu(5))
    policy.history = []
    sched = Scheduler(target, draft, target.max_context, 4, feature_layers_for(draft), policy=policy)
    prompts = [tiny_tokenizer.encode(p)[-60:] for p in dev_prompts[40:43]]
    drive(sched, prompts, [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 3)
    admissions = [h for h in policy.history if h[0] == "admission"]
    records = [h for h in policy.history if h[0] != "admission"]
    assert admissions and admissions[0][3] == 3 and admissions[0][2] > 0  # 3 requests running after it
    assert records and all(len(h) == 9 for h in records)
    times = [h[1] if h[0] == "admission" else h[8] for h in policy.history]
    assert times == sorted(times) and admissions[0][1] < records[0][8]


def test_a_buckets_tail_is_not_sampled_until_a_smaller_load_lasts():
    """A batch that came together ends together: at its end the bucket's requests finish, and a step of 39 of 64
    requests costs more per request (0.36 ms a request-step against 0.24: 8B shape, tau 3, H200). Only the budget
    followed at the end took those samples, read slower than its rival and lost the next batch to it. A call of
    fewer than `settled_fraction` of the bucket's recent peak is not sampled; the peak decays, so a load that
    stays smaller is sampled again after a while."""
    p = SpeculationPolicy(budgets=(0, FULL), min_samples=2, min_request_steps=1)
    for budget, secs in ((0, 0.0065), (FULL, 0.015)):
        for _ in range(3):
            p.record(64, budget, tokens=64 * (1 if budget == 0 else 3), seconds=secs, steps=1)
    before = dict(p.rates)
    assert p._best(64) == FULL
    p.history = []
    for n in (55, 49, 39):  # the tail under FULL: dearer steps per request, and a low yield
        p.record(n, FULL, tokens=n * 3 if n == 55 else int(n * 1.4), seconds=0.015 if n == 55 else 0.014, steps=1)
    assert p.rates[(64, FULL)] < before[(64, FULL)]  # 55 is still within the settled fraction of 64
    assert [h[0] for h in p.history] == ["step", "tail", "tail"]
    assert p._best(64) == FULL
    lasting = 0
    while p.history[-1][0] != "step":  # a load of 40 that stays
        p.record(40, FULL, tokens=120, seconds=0.012, steps=1)
        lasting += 1
    assert 20 < lasting < 40 and p.rates[(64, FULL)] != before[(64, FULL)]


def test_a_request_its_length_limit_could_end_in_the_call_is_left_out_of_the_yield(dev_prompts, tiny_tokenizer):
    """Of the requests close to their max_new_tokens only those that accepted little are still running after a
    speculative step: counted, they read the budget's acceptance low (the last steps of a run at 64 requests, tau 3,
    read 1.4-2.6 tokens a step). A request whose room is at most what the call could commit is not counted."""
    target, draft = tiny_target(), tiny_draft()  # chains of 5: a step commits at most 6 tokens
    # Prompt pairs in turn until the short request lives through a recorded step beside the long one (with some
    # prompts it accepts its whole room at once; the tests' prompts change with the project's code when
    # ../shared is absent). Every pair must keep the rule.
    both_seen = 0
    for first in range(44, 60, 2):
        policy = SpeculationPolicy(budgets=(FULL,))
        policy.history = []
        sched = Scheduler(target, draft, target.max_context, 4, feature_layers_for(draft), policy=policy)
        prompts = [tiny_tokenizer.encode(p)[-60:] for p in dev_prompts[first:first + 2]]
        out = drive(sched, prompts, [SamplingParams(max_new_tokens=40, ignore_eos=True),
                                     SamplingParams(max_new_tokens=7, ignore_eos=True)])
        assert [len(t) for t in out.values()] == [40, 7]
        both = [h for h in policy.history if h[0] != "admission" and h[1] == 2]
        assert all(h[6] <= 1 for h in both)  # the short request (room 6 after the prefill) never counted
        assert sum(h[6] for h in policy.history if h[0] != "admission") >= 5
        both_seen += bool(both)
        if both_seen:
            break
    assert both_seen, "no prompt pair kept the short request through a recorded step"


class _Recorder(SpeculationPolicy):
    """Decodes plainly and keeps what the scheduler records."""

    def __init__(self):
        super().__init__(budgets=(0, FULL))
        self.calls = []

    def choose(self, batch_size: int) -> int:
        return 0

    def record(self, batch_size, budget, tokens, seconds, steps=1, yielding=None, chosen_at=None, derived=None):
        self.calls.append((batch_size, steps, yielding))


def test_a_call_in_which_many_requests_end_is_not_sampled(dev_prompts, tiny_tokenizer):
    """A call in which a batch's requests end together ran 25-35% slower a plain step (128 requests, 8B shape,
    H200) and once left plain's rate under the half chain's for a whole batch: a call in which at least 1 in
    `ENDING_SHARE` of its requests finish is not sampled; one of 9 ending is."""
    target, draft = tiny_target(), tiny_draft()
    policy = _Recorder()
    sched = Scheduler(target, draft, target.max_context, 16, feature_layers_for(draft), policy=policy, plain_steps=4)
    prompts = [tiny_tokenizer.encode(p)[-40:] for p in dev_prompts[:9]]
    # the first request ends inside the third call (1 of 9), the other 8 together inside the sixth
    params = [SamplingParams(max_new_tokens=11, ignore_eos=True)] + [SamplingParams(max_new_tokens=25,
                                                                                    ignore_eos=True)] * 8
    out = drive(sched, prompts, params)
    assert sorted(len(t) for t in out.values()) == [11] + [25] * 8
    assert policy.calls == [(9, 4, 9), (9, 4, 9), (9, 4, 8), (8, 4, 8), (8, 4, 8)]  # the sixth call is not there


def test_a_menu_of_one_budget_just_follows_it():
    """Nothing to re-measure against (a menu of one): the policy follows it however long it runs."""
    for only in ((FULL,), (0,)):
        p = SpeculationPolicy(budgets=only, explore_every=2, max_explore_every=4, min_samples=1, min_request_steps=1)
        for _ in range(50):
            assert p.choose(8) == only[0]
            p.record(8, only[0], tokens=16, seconds=0.01)


def test_a_requests_first_steps_do_not_decide_between_chains_on_their_own():
    """The README's command (tiny pair, 2-core CPU, one 64-token request): the whole chain of 5 accepted 0-3 drafts on
    its first steps (short context) and 5 on most later ones. Its calibrated times (half chain 21 ms a step, whole 32.5
    ms) make the half chain lead after 8 request-steps, and the request then ran at tau 2.52 instead of 3.94 (4 runs of
    6); measured over `min_request_steps` (16) the whole chain keeps its lead."""
    accepted = [0, 3, 2, 1, 0, 5, 2, 5, 3, 5, 5, 5, 5, 5, 5, 5, 5, 5]

    def run(min_request_steps: int) -> list[int]:
        p = SpeculationPolicy(budget_menu(5), min_samples=3, min_request_steps=min_request_steps, derives_yields=True)
        for budget, seconds in ((0, 0.015), (2, 0.021), (FULL, 0.0325)):
            p.seed(1, budget, seconds)
        chosen = []
        for a in accepted:
            budget = p.choose(1)
            chosen.append(budget)
            kept = 5 if budget == FULL else budget
            p.record(1, budget, 1 + min(a, kept), 0.0325 if budget == FULL else 0.021,
                     derived={2: 1 + min(a, 2)} if budget == FULL else None)
        return chosen

    assert run(8)[8:] == [2] * 10  # the first 8 steps alone: the half chain leads
    assert run(16) == [FULL] * len(accepted)


def test_no_re_measurement_interval_is_longer_than_max_explore_every_target_steps():
    """A plain choice runs `plain_call_steps` target steps (16 on a GPU, 4 on a CPU). Intervals count choices, but
    none runs longer than `max_explore_every` (256) target steps: counted in choices alone, a plain choice of 16 steps
    waited up to 4,096 tokens a request before speculation was re-measured, and a plain choice made while the CPU
    was shared held ~15 requests."""

    def gaps(plain_call_steps: int, speed: dict[int, float], steps: int = 400) -> list[int]:
        p = SpeculationPolicy(explore_every=16, max_explore_every=256, min_samples=2, min_request_steps=1,
                              plain_call_steps=plain_call_steps, explore_cost=0)  # (steps alone: see below)
        chosen = _drive(p, 1, speed, steps=steps)
        full = [i for i, b in enumerate(chosen) if b == FULL]
        starts = [x for i, x in enumerate(full) if not i or full[i - 1] != x - 1][1:]  # after its first measurement
        return [b - a for a, b in zip(starts, starts[1:], strict=False)]  # (each: the interval + 1, its 2nd choice)

    close = {0: 100.0, FULL: 60.0}  # plain leads, the whole tree within half of it: the interval backs off
    assert gaps(1, close) == [33, 65, 129]  # counted in choices: 32, 64, 128 ... up to 256
    assert gaps(4, close) == [33, 65, 65, 65, 65, 65]  # a CPU's 4-step calls: capped at 64 calls = 256 steps
    assert set(gaps(16, close)) == {17}  # a GPU's 16-step calls: 16 calls from the start (not 1, 2, 4 ...)
    far = {0: 100.0, FULL: 10.0}  # every rival under half plain's rate: the longest interval at once
    assert set(gaps(16, far)) == {17}
    p = SpeculationPolicy(explore_every=16, max_explore_every=256, min_samples=2, min_request_steps=1,
                          plain_call_steps=16, explore_cost=0)
    _drive(p, 1, far, steps=80)
    far[FULL] = 400.0  # speculation turns 40x faster: its re-measurements pull its yield up until it leads
    assert _drive(p, 1, far, steps=120)[-5:] == [FULL] * 5


def test_a_plain_call_records_no_propose_span(dev_prompts, tiny_tokenizer):
    """A plain call proposes nothing: its step has a `draft.verify` span (num_draft_tokens 0) and no `draft.propose`
    one, as its `propose` phase metric records nothing (QA: 33 propose spans against 12 observations)."""
    from opentelemetry import context as otel_context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from specdec.telemetry import StepSpanSampler

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    target, draft = tiny_target(), tiny_draft()
    policy = SpeculationPolicy((0,))  # a menu of plain decoding alone
    sched = Scheduler(target, draft, target.max_context, 4, feature_layers_for(draft), policy=policy,
                      step_spans=StepSpanSampler(1.0, provider.get_tracer("steps")))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("request"):  # a traced request: its steps' spans join its trace
        sched.add("r", tiny_tokenizer.encode(dev_prompts[0])[-40:], SamplingParams(max_new_tokens=12),
                  trace_context=otel_context.get_current())
    while sched.has_work:
        sched.step()
    names = [s.name for s in exporter.get_finished_spans()]
    assert "draft.verify" in names and "draft.propose" not in names
    assert all(s.attributes["num_draft_tokens"] == 0 for s in exporter.get_finished_spans() if s.name == "draft.verify")


def _run_timed(p: SpeculationPolicy, seconds: dict[int, float], tokens: dict[int, float], until_s: float,
               clock: float = 0.0) -> tuple[list[tuple[float, int]], float]:
    """Batch 1 for `until_s` seconds of simulated time: a choice of budget x takes seconds[x] and commits tokens[x]
    (a plain choice: `plain_call_steps` steps, one token each) -> ((time chosen, budget) ..., the clock after)."""
    chosen, end = [], clock + until_s
    while clock < end:
        b = p.choose(1)
        chosen.append((clock, b))
        steps = p.plain_call_steps if b == 0 else 1
        p.record(1, b, tokens=tokens[b] * steps, seconds=seconds[b], steps=steps)
        clock += seconds[b]
    return chosen, clock


def test_a_far_rival_is_re_measured_only_as_often_as_it_costs_little():
    """The tiny pair at batch 1 on an H200: a 16-step plain call takes 8 ms (0.5 ms a token), a half-chain step
    ~10 ms for 2.4 tokens, the whole chain ~20 ms for 4 (`auto` measured plain 1993, half 237, whole 205 tok/s).
    Re-measured every 256 plain steps (128 ms) the half chain took ~14% of the time here (more with its catch-up);
    now a rival that far behind waits until its re-measurement costs at most `explore_cost` (5%) of the time since
    the last one. A rival near the choice keeps the schedule in steps."""
    seconds = {0: 0.008, 2: 0.010, FULL: 0.020}
    tokens = {0: 1.0, 2: 2.4, FULL: 4.0}

    def spent(explore_cost: float) -> tuple[float, SpeculationPolicy]:
        p = SpeculationPolicy(budgets=(0, 2, FULL), min_samples=2, min_request_steps=4, plain_call_steps=16,
                              explore_cost=explore_cost)
        _run_timed(p, seconds, tokens, 2.0)  # measured and settled on plain
        chosen, _ = _run_timed(p, seconds, tokens, 20.0, clock=2.0)
        return sum(seconds[b] for _, b in chosen if b) / 20.0, p

    before, _ = spent(0.0)
    after, p = spent(0.05)
    assert before > 0.12, before
    assert 0.01 < after < 0.06, after  # still re-measured, at ~5% of the time
    assert p._best(1) == 0
    # speculation turns fast (the half chain 3 tokens a ms, the whole chain 6 in 2 ms: both beat plain's 2 a ms):
    # the re-measurements of the half chain, its neighbour, find speculation within seconds (each moves its
    # averages a step: with them every 128 ms, as before, it took about as long), and the whole chain leads
    tokens.update({2: 3.0, FULL: 6.0})
    seconds.update({2: 0.001, FULL: 0.002})
    waited = 0.0
    while p.followed.get(1) == 0 and waited < 5.0:
        _run_timed(p, seconds, tokens, 0.1)
        waited += 0.1
    assert p.followed[1] != 0 and waited < 3.0, waited
    _run_timed(p, seconds, tokens, 1.0)
    assert p._best(1) == FULL
    near = SpeculationPolicy(budgets=(0, FULL), min_samples=2, min_request_steps=4, plain_call_steps=16,
                             explore_cost=0.05)  # the whole chain at 0.75x plain's rate: not far behind
    chosen, _ = _run_timed(near, {0: 0.008, FULL: 0.008}, {0: 1.0, FULL: 12.0}, 4.0)
    probes = [i for i, (_, b) in enumerate(chosen) if b and i > 10]
    assert probes and max(b - a for a, b in zip(probes, probes[1:], strict=False)) <= 17  # every 256 steps
