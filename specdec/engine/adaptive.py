"""Adaptive speculation: per step, how many draft tokens to verify (0 = decode plainly), whichever budget has
recently delivered the most tokens per second at this batch size. Every budget is lossless: a plain step is a
verify of empty trees, a smaller budget verifies the draft's best `budget` nodes.

Throughput is measured, not modelled: each call records (batch size, budget, tokens committed, seconds, target
steps), and per (batch-size bucket, budget) the policy keeps two averages whose ratio is the budget's tokens/s:
seconds per request-step (a running mean over its first samples, then an exponential moving average, weight `ema`: a
step's time varies little; a step then enters clipped to `max_step_ratio` times the average, so a one-off stall does
not halve a rate until its next re-measurement), and tokens per request-step (the acceptance; a running mean that
turns into a moving average in which each request of a step weighs `yield_ema`). A plain call of k steps is k
request-steps per request, and the yield counts only requests that did not finish in the call (a last call is cut
short by a length limit: one such call at 128 requests once halved plain's rate). Tokens per step vary a lot from
step to step (0 to all draft tokens accepted), and a moving average of per-step rates kept that noise: simulating
the tiny pair at batch 1, its estimate strayed 15-18% on average (up to 60%), the averages above 4-7% (a test).
The scheduler also leaves out of the yield a request that its length limit could have ended inside the call:
of those, only the ones that accepted little are still running after it. And a call of fewer requests than
`settled_fraction` of its bucket's recent peak is not sampled at all (a batch's tail: a bucket spans a factor of
two and a step's cost per request grows toward its small end; the budget followed at the end alone paid for it).

A bucket measures the menu's budgets in order (`min_samples` steps each, and `min_request_steps` request-steps of
a speculative one: at batch 1, three steps read tau 4.8 as 3.3), then follows the fastest and keeps re-measuring
its rivals (in turn), so a change in acceptance (a new prompt mix) or load moves the choice. Tokens/s need not
rise then fall along the menu: at small batch half the tree can lose narrowly to plain decoding while the whole
tree wins (the verify costs about the same; a captured chain proposal still runs every step, an eager chain only
as many steps as the budget keeps). So a budget is skipped only when the one before it lost by more than half (at
large batch a big tree can cost ten plain steps), and rivals are the neighbours of the choice plus any budget
within `far_rival` (80%) of its rate.

Plain calls leave the draft behind (it skips their tokens but the last: `Scheduler._hold`), so a plain call costs
what the target's own plain decoding costs plus a round trip, and a speculative step after plain ones pays a
one-token catch-up and acceptance a little lower for the skipped context: each budget's rate holds its own costs.
Not a switch's, though: the first landing of a budget after another one's (in a bucket) fills the pipeline (the
draft settles and catches up, the first micro-batch's verify has nothing to overlap) and is left out of the
averages, so a re-measurement runs the rival until one steady landing is measured (at most `probe_choices`
choices; usually two). Averaged in,
the first two landings after each switch (2.4x and 1.7x a steady micro-step: 8B shape, tau 5, 64 requests, 2 x
H200) pulled the whole chain's rate under plain decoding's, though its steady steps ran 1.5x plain's rate; the
stretches between switches are long (16-256 choices), so the steady rates are what decide.
Re-measuring costs (a rival's slower steps), so the interval backs off: it starts at `explore_every` choices,
doubles (up to `max_explore_every`) each time a re-measurement confirms the choice, and resets when one overturns it
(while every rival measured under half the choice's rate it is `max_explore_every`, and a rival that far behind is
re-measured only once its measured cost is at most `explore_cost` of the time since the last re-measurement: on a
GPU the tiny pair's plain step is 0.5 ms and a half-chain step ~10 ms, and re-measuring it every 256 plain steps
held `auto` at 0.58x of `Generate` at batch 1); a rival overturns it only by
measuring `switch_margin` faster (3%: near ties otherwise flip on every re-measurement), except plain decoding,
which overturns a speculative choice at `plain_margin` (1%). No interval is longer than `max_explore_every` target
steps (a plain choice runs `plain_call_steps`). Buckets are powers of two. The menu (`budget_menu`) is plain, about half
the tree, and the whole tree: at large batch a verify is compute-bound and its cost grows with the tokens
verified, so a shorter chain can beat both extremes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

FULL = -1  # budget: the draft's whole tree (its --num-draft-tokens)
# choices a re-measurement is reckoned to cost, at its rival's measured time (`SpeculationPolicy._affordable`): its
# first landing only warms up (the pipeline fills, the draft catches up: ~2.4x a steady one), the next is sampled
PROBE_COST_CHOICES = 3


def budget_menu(num_draft_tokens: int) -> tuple[int, ...]:
    """Budgets tried by `--speculation auto`: plain, about half the tree (trees of 4+ tokens), the whole tree."""
    half = num_draft_tokens // 2
    return (0, half, FULL) if half >= 2 else (0, FULL)


def budget_name(budget: int) -> str:
    return "plain" if budget == 0 else "full" if budget == FULL else f"d{budget}"


@dataclass
class SpeculationPolicy:
    budgets: tuple[int, ...] = (0, FULL)
    explore_every: int = 16  # first interval (in choices) between re-measurements of the budgets not chosen
    max_explore_every: int = 256
    # target steps one plain choice runs (the scheduler's --plain-steps): an interval counts choices, but none is
    # longer than `max_explore_every` target steps. Counted in choices alone, a plain choice of 16 steps (H200)
    # stretched the longest interval to 4,096 tokens a request, and a wrong plain choice at batch 1 (made while the
    # CPU was shared with a test suite) held ~15 requests; counted in target steps alone, speculation that lost
    # to plain decoding was re-measured after 1, 2, 4 ... plain calls, and 128-token runs at 32 requests (8B shape,
    # tau 3, two processes, H200) fell from 0.99x to 0.87-0.96x of Generate
    plain_call_steps: int = 1
    ema: float = 0.3  # weight of the newest step in the seconds-per-step averages
    yield_ema: float = 0.03  # weight of one request of the newest step in the tokens-per-step averages
    min_samples: int = 3  # steps of each budget before the averages decide (the first one only warms up)
    # and request-steps behind a speculative budget's yield: at batch 1 it is 1 to 7 tokens a step, and three
    # samples (two after the warm-up) once read the whole chain at tau 3.3 instead of 4.8 (H200, session 7); eight
    # still decided on a request's first steps, whose short context accepts least: the README's command (tiny pair,
    # CPU) read the whole chain's first 8 steps at 3.25 tokens (3.94 over the request), and in 4 of 6 runs the
    # half chain's 2.4 led it where calibration timed the half chain fast; the request then ran at tau 2.52
    min_request_steps: int = 16
    max_step_ratio: float = 2.0  # a step's seconds enter the average clipped to this multiple of it
    # a rival replaces the followed budget only when it measures this much faster: two budgets within noise of each
    # other (the whole tree and plain at 128 requests on the H200 measured 0.4% apart) otherwise trade places on
    # every re-measurement, each flip paying a switch and resetting the re-measurement interval
    switch_margin: float = 0.03
    plain_margin: float = 0.01  # the same, for plain decoding to replace a speculative budget (see `_best`)
    # a re-measurement of a rival lasts until it has recorded a steady sample (the first landing after a switch
    # only warms up), at most this many choices: a landing at a request's end or beside an admission is not
    # sampled, and a fixed two choices then measured nothing (CPU, two drafts on one target: 6 of 20 re-measurements)
    probe_choices: int = 4
    # a rival under half the choice's rate is re-measured only when that costs at most this fraction of the time
    # recorded at its bucket since the last re-measurement (0: as soon as the interval is up). Counted in steps
    # alone, a half-chain step of ~10 ms re-measured every 256 plain steps of 0.5 ms (the tiny pair at batch 1 on an
    # H200) cost ~40% of the time: `auto` ran at 0.58x the target's `Generate`, 1.00x with `--speculation off`
    explore_cost: float = 0.05
    far_rival: float = 0.8  # a budget not next to the choice in the menu is re-measured only within this of its rate
    # a call of fewer requests than this fraction of its bucket's recent peak batch size is not sampled (a run's
    # tail: see `record`); the peak falls by `peak_decay` a record, so a lasting smaller load is sampled again
    settled_fraction: float = 0.85
    peak_decay: float = 0.99
    rates: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, budget) -> tokens/s
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)  # -> seconds per request-step
    tokens: dict[tuple[int, int], float] = field(default_factory=dict)  # -> tokens per request-step
    counted: dict[tuple[int, int], int] = field(default_factory=dict)  # -> request-steps behind `tokens`
    samples: dict[tuple[int, int], int] = field(default_factory=dict)
    intervals: dict[int, int] = field(default_factory=dict)  # bucket -> current re-measurement interval
    since: dict[int, int] = field(default_factory=dict)  # bucket -> steps since the last re-measurement
    since_s: dict[int, float] = field(default_factory=dict)  # bucket -> seconds recorded since then
    challenged: dict[int, int] = field(default_factory=dict)  # bucket -> the choice a pending re-measurement tests
    turn: dict[int, int] = field(default_factory=dict)  # bucket -> which other budget is re-measured next
    followed: dict[int, int] = field(default_factory=dict)  # bucket -> the budget it last followed
    probing: dict[int, tuple[int, int]] = field(default_factory=dict)  # bucket -> (rival, its choices still to run)
    clipped: dict[tuple[int, int], float] = field(default_factory=dict)  # -> what the last sample's clip cut off
    recorded: dict[int, int] = field(default_factory=dict)  # bucket -> the budget of its latest record
    target_steps: dict[int, int] = field(default_factory=dict)  # budget -> target steps recorded with it
    peaks: dict[int, float] = field(default_factory=dict)  # bucket -> recent peak batch size (decaying)
    # chains (topk 1): a step of a budget tells what each smaller one would have committed (the first h nodes of a
    # chain are the h-budget's tree; a request that accepted a drafts would have accepted min(a, h)), so those
    # yields are counted from every step (`record`'s `derived`) and a smaller budget's time is all it must measure
    derives_yields: bool = False
    # tokens a request-step of the whole tree commits at most: its depth (--num-steps) plus the target's own token
    # (the scheduler sets it; 0: unknown). A budget whose time alone, at that yield, loses to plain decoding's
    # measured rate counts as measured (`_cannot_win`): nothing its acceptance could be makes it win
    max_step_tokens: int = 0
    # a list: every record is appended to it, (kind, batch size, budget, tokens, seconds, steps, yielding, chosen at,
    # time.perf_counter()), and the scheduler's admissions as ("admission", start, seconds, admitted) (diagnosis:
    # benchmarks, and the draft service's SPECDEC_POLICY_HISTORY)
    history: list | None = None

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()

    def choose(self, batch_size: int) -> int:
        """The draft-token budget for this step: 0 = decode plainly, FULL = the whole tree, else a node count."""
        b = self.bucket(batch_size)
        self._borrow_yields(b)
        unmeasured = self._next_unmeasured(b)
        if unmeasured is not None:
            return unmeasured
        probe = self.probing.pop(b, None)
        if probe is not None:  # a re-measurement goes on
            rival, left = probe  # (it ends at the rival's first steady sample: `record`)
            if left > 1:
                self.probing[b] = (rival, left - 1)
            return rival
        best = self._best(b)
        if self.followed.get(b) != best and len(self.budgets) > 1:  # operators see each change of course (rare:
            # `switch_margin`; a menu of one budget, calibration's, has no course to change)
            rates = ", ".join(f"{budget_name(x)} {self.rates[(b, x)]:.0f}" for x in self._measured(b))
            log.info("speculation policy: batch-size bucket %d follows %s now (tokens/s %s)", b, budget_name(best),
                     rates, extra={"batch_bucket": b, "budget": budget_name(best)})
        self.followed[b] = best
        weight = self.plain_call_steps if best == 0 else 1  # target steps of this choice
        since = self.since.get(b, 0) + weight
        due = min(self._interval(b, best) * weight, max(self.max_explore_every, weight))
        others = self._rivals(b, best) if since >= due else []
        turn = self.turn.get(b, 0)
        skip = next((k for k in range(len(others)) if self._affordable(b, others[(turn + k) % len(others)],
                                                                         batch_size)), None)
        if skip is not None:  # (None: a menu of one budget, nothing to re-measure; or a far rival not yet worth it)
            turn += skip
            rival = others[turn % len(others)]
            self.since[b], self.since_s[b], self.challenged[b], self.turn[b] = 0, 0.0, best, turn + 1
            if self.probe_choices > 1:
                self.probing[b] = (rival, self.probe_choices - 1)
            return rival
        self.since[b] = since
        return best

    def _affordable(self, b: int, rival: int, batch_size: int) -> bool:
        """May `rival` be re-measured now? Yes, unless it measured under half the best rate and its re-measurement
        (`PROBE_COST_CHOICES` choices of `batch_size` requests at its measured time) would cost more than
        `explore_cost` of the time recorded at bucket `b` since the last one."""
        key = (b, rival)
        if not self.explore_cost or key not in self.rates or not self._far_behind(b, rival):
            return True
        steps = self.plain_call_steps if rival == 0 else 1
        cost = PROBE_COST_CHOICES * self.seconds[key] * batch_size * steps
        return cost <= self.explore_cost * self.since_s.get(b, 0.0)

    def _interval(self, b: int, best: int) -> int:
        """Steps between re-measurements at bucket `b`: the backing-off interval, or the longest one when every
        rival measured under half of `best`'s rate (a neighbour that far behind is still re-measured, rarely: at
        batch 1 on the tiny pair on a GPU the half chain ran at under a quarter of plain decoding's rate, and 9 of
        248 target steps were its re-measurements)."""
        if all(self._is_measured(b, x) and self._far_behind(b, x) for x in self._rivals(b, best)):
            return self.max_explore_every
        return self.intervals.get(b, self.explore_every)

    def _next_unmeasured(self, b: int) -> int | None:
        """The next budget of the menu to measure at bucket `b` (None: all that will be tried are measured)."""
        top = self.budgets[-1]
        for i, budget in enumerate(self.budgets):
            if not self._is_measured(b, budget):
                if self.derives_yields and budget not in (0, top) and self._timed(b, budget) \
                        and not self._is_measured(b, top):
                    return top  # this one's time is known (`seed`, or its first steps): the biggest's yield it
                if i and self._far_behind(b, self.budgets[i - 1]):
                    return None  # the smaller budget lost by more than half: the bigger (costlier) ones are not tried
                return budget
        return None

    def plain_leads(self, batch_size: int) -> bool:
        """Has this batch size's bucket measured its menu and found plain decoding the fastest?"""
        b = self.bucket(batch_size)
        self._borrow_yields(b)
        return self._next_unmeasured(b) is None and bool(self._measured(b)) and self._best(b) == 0

    def _measured(self, b: int) -> list[int]:
        return [x for x in self.budgets if self._is_measured(b, x)]

    def _is_measured(self, b: int, budget: int) -> bool:
        key = (b, budget)
        return self._timed(b, budget) and (budget == 0  # a plain step yields 1 per step
                                           or self.counted.get(key, 0) >= self.min_request_steps
                                           or self._cannot_win(b, budget))

    def _ceiling(self, budget: int) -> int:
        """The most tokens a request-step of `budget` commits: the drafts of one path (at most the tree's depth, at
        most the budget's nodes) and the target's token after them; 0: the depth is unknown."""
        if not self.max_step_tokens:
            return 0
        return self.max_step_tokens if budget == FULL else min(budget, self.max_step_tokens - 1) + 1

    def _cannot_win(self, b: int, budget: int) -> bool:
        """Does `budget`'s measured time at bucket `b` lose to plain decoding's measured rate even if every draft
        token were accepted? Its yield then need not be measured: it is taken as that ceiling (so its rate stays an
        upper bound) until its own steps measure it. On a GPU the bundled tiny target's step is host-bound: at batch 1
        a whole-chain step took ~5 ms against plain decoding's 0.42 ms a token, and the policy ran 16 whole-chain
        steps (its yield's `min_request_steps`) of a fresh draft's first 128-token request to learn that, which left
        the request at 0.54-0.65x of the target's `Generate` (H200, session 30)."""
        key, plain = (b, budget), (b, 0)
        ceiling = self._ceiling(budget)
        if not ceiling or plain not in self.rates or not self._timed(b, 0) or key not in self.seconds:
            return False
        if ceiling / self.seconds[key] >= self.rates[plain]:
            return False
        if key not in self.tokens:
            self.rates[key] = ceiling / self.seconds[key]
        return True

    def _timed(self, b: int, budget: int) -> bool:
        return self.samples.get((b, budget), 0) >= self.min_samples

    def seed(self, batch_size: int, budget: int, seconds: float) -> None:
        """Take `seconds` per request-step as `budget`'s measured time at `batch_size`'s bucket (the draft's start-up
        calibration, `specdec.engine.calibration`): plain decoding (one token a request-step) is then measured
        outright, a speculative budget still needs its yield from real requests. Later steps average into it."""
        key = (self.bucket(batch_size), budget)
        self.seconds[key] = seconds
        self.samples[key] = max(self.samples.get(key, 0), self.min_samples)
        if budget == 0:
            self.tokens[key], self.counted[key] = 1.0, self.min_request_steps
        if key in self.tokens:
            self._rate(key)

    def _borrow_yields(self, b: int) -> None:
        """A speculative budget timed at bucket `b` (start-up calibration times every bucket on a GPU) but with no
        yield there takes the yield of the nearest bucket that measured one: acceptance is the drafts' and the
        prompts', not the batch size's. The bucket then chooses from its first step instead of running the whole
        tree until its own requests have measured it (at 128 requests of an 8B shape, tau 5, H200: two or three
        whole-chain steps of ~70 ms where plain decoding led, and the first admission brought prompt features the
        draft did not use). The borrowed yield counts as `min_request_steps` request-steps, so the bucket's own
        steps replace it as soon as they run."""
        for budget in self.budgets:
            if budget == 0 or (b, budget) in self.tokens or not self._timed(b, budget):
                continue
            donors = [d for (d, x), n in self.counted.items() if x == budget and d != b and n >= self.min_request_steps]
            if donors:
                donor = min(donors, key=lambda d: (abs(d.bit_length() - b.bit_length()), d))
                self.tokens[(b, budget)] = self.tokens[(donor, budget)]
                self.counted[(b, budget)] = self.min_request_steps
                self._rate((b, budget))

    def _far_behind(self, b: int, budget: int) -> bool:
        """Did `budget` measure under half the rate of the best measured one?"""
        return self.rates[(b, budget)] < 0.5 * max(self.rates[(b, x)] for x in self._measured(b))

    def _rivals(self, b: int, best: int) -> list[int]:
        """The budgets re-measured (in turn) against `best`: its neighbours in the menu, and any other measured
        budget within `far_rival` of its rate. A far budget that lost clearly (the whole tree where plain decoding
        leads: at 128 requests, tau 3, 8B shape, H200 it ran at 0.65x plain's rate, and each of its probes cost
        ~30 ms more than the half chain's) is not probed at its high cost; the neighbour between them is, and
        once it leads the far one is its neighbour. One that lost narrowly is probed."""
        i = self.budgets.index(best)
        near = {self.budgets[j] for j in (i - 1, i + 1) if 0 <= j < len(self.budgets)}
        top = self.rates.get((b, best), 0.0)
        return [x for x in self.budgets if x != best and (x in near or x in self._measured(b)
                                                            and self.rates[(b, x)] >= self.far_rival * top)]

    def _best(self, b: int) -> int:
        """The fastest measured budget (ties go to the one listed last: more speculation), unless the budget
        followed so far is within `switch_margin` of it. Plain decoding takes over from a speculative budget at
        a smaller lead, `plain_margin`: speculation is there to beat plain decoding, and between near-equals plain
        is the one that costs the GPUs less. (Symmetric, the margin kept half the chain 22 steps at 0.96x plain's
        rate at 128 requests, tau 3, H200, fifteenth pass.) Back from plain to speculation still takes the
        margin, so two near-equals do not trade places on every re-measurement."""
        measured = self._measured(b)
        top = max(reversed(measured), key=lambda x: self.rates[(b, x)])
        held = self.followed.get(b)
        margin = self.plain_margin if top == 0 else self.switch_margin
        if held in measured and self.rates[(b, top)] <= (1 + margin) * self.rates[(b, held)]:
            return held
        return top

    def record(self, batch_size: int, budget: int, tokens: int, seconds: float, steps: int = 1,
               yielding: int | None = None, chosen_at: int | None = None,
               derived: dict[int, int] | None = None) -> None:
        """One call of `batch_size` requests with `budget`: `seconds` for `steps` target steps (a plain call runs
        several; each is one request-step per request), in which `yielding` of the requests (default: all) that
        did not finish in the call committed `tokens`. A request's last call is cut short by its length limit or
        stop token: counted in the yield it read as low acceptance (one plain call at the end of a batch of
        requests once halved plain's rate at 128 requests on the H200); it still counts in the time.
        `chosen_at`: the batch size whose bucket chose the budget (default `batch_size`): under two-batch overlap
        a micro-batch's choice of plain decoding runs the whole batch plainly. `derived`: smaller budgets -> the
        tokens the same requests would have committed with them (`derives_yields`), counted in their yields."""
        yielding = batch_size if yielding is None else yielding
        chosen_at = chosen_at or batch_size
        key = (self.bucket(chosen_at), budget)
        if batch_size < 1:
            return
        # every call the target ran is counted, the one that finished all its requests too (QA: at batch 1 each
        # request's last step went uncounted)
        self.target_steps[budget] = self.target_steps.get(budget, 0) + max(1, steps)
        if seconds <= 0 or (yielding < 1 and key not in self.tokens):
            return
        b = key[0]
        self.since_s[b] = self.since_s.get(b, 0.0) + seconds
        switched, self.recorded[b] = self.recorded.get(b, budget) != budget, budget
        self.peaks[b] = peak = max(chosen_at, self.peak_decay * self.peaks.get(b, 0.0))
        tail = chosen_at < self.settled_fraction * peak
        if self.history is not None:
            kind = "tail" if tail else "warm-up" if switched and key in self.seconds else "step"
            self.history.append((kind, batch_size, budget, tokens, round(seconds, 6), steps, yielding, chosen_at,
                                 time.perf_counter()))
        if switched and key in self.seconds:  # the pipeline fills after a switch: not this budget's steady rate
            self.clipped.pop(key, None)
            return
        if tail:  # a bucket's requests finishing (a batch that came together ends together): it spans a factor of
            # two, and at the small end a step costs more per request (39 of 64 requests: 0.36 ms a request-step
            # against 0.24, tau 3, 8B shape, H200); the budget followed at the end alone took those samples and
            # read slower than its rivals, so the next batch of 64 followed plain decoding at 0.79x d3's rate
            return
        steps = max(1, steps)
        step_s = seconds / (batch_size * steps)
        done = self.samples.get(key, 0)
        first = done <= 1  # sample 0 (lazy inits, graph capture) is overwritten by sample 1
        # a running mean over the first samples, then a moving average: a pipelined call can land right after
        # the one before it (the draft's landing, not the target, was the bottleneck: 2 ms after 224 ms on the
        # CPU), and such a sample alone was the baseline that the clip below then held for dozens of samples
        weight = 1.0 if first else max(1.0 / done, self.ema)
        if weight == self.ema:  # a one-off stall (a 200 ms pause among 40 ms steps on the H200) moves it this far
            step_s = self._clip(key, step_s)
        self.seconds[key] = step_s if first else self.seconds[key] + weight * (step_s - self.seconds[key])
        if yielding:
            self._add_yield(key, tokens / (yielding * steps), yielding, reset=first and not self.derives_yields)
            for smaller, committed in (derived or {}).items():
                self._add_yield((b, smaller), committed / yielding, yielding)
                if (b, smaller) in self.seconds:
                    self._rate((b, smaller))
        self._rate(key)
        self.samples[key] = self.samples.get(key, 0) + 1
        if self.probing.get(b, (None,))[0] == budget:  # the re-measurement has its sample
            del self.probing[b]
        if b in self.challenged and budget != self.challenged[b]:  # the re-measurement came back
            held = self._best(b) == self.challenged.pop(b)
            interval = self.intervals.get(b, self.explore_every)
            self.intervals[b] = min(2 * interval, self.max_explore_every) if held else self.explore_every

    def _clip(self, key: tuple[int, int], step_s: float) -> float:
        """A steady sample's seconds per request-step, at most `max_step_ratio` times the average. A sample under
        1 / `max_step_ratio` of the average right after a clipped one takes back what the clip cut off: landings of
        pipelined calls come in pairs when the draft, not the target, is behind (the second call was done while the
        first landed: 238 ms then 3 ms, one CPU shared by two drafts' load), and clipping the long one alone read
        plain decoding at 2.6x its real rate on average (`bench/policy_replay.py`); a one-off stall is followed by a
        normal sample and stays clipped."""
        average = self.seconds[key]
        cap = self.max_step_ratio * average
        if step_s * self.max_step_ratio < average:
            step_s += self.clipped.get(key, 0.0)
        self.clipped[key] = max(0.0, step_s - cap)
        return min(step_s, cap)

    def _add_yield(self, key: tuple[int, int], step_tokens: float, yielding: int, reset: bool = False) -> None:
        """Average `yielding` request-steps of `step_tokens` each into `key`'s tokens per request-step (`reset`:
        they replace it, as the first samples' times do)."""
        if reset or key not in self.tokens:
            self.tokens[key], self.counted[key] = step_tokens, yielding
            return
        n = self.counted[key]
        weight = max(yielding / (n + yielding), 1 - (1 - self.yield_ema) ** yielding)
        self.tokens[key] += weight * (step_tokens - self.tokens[key])
        self.counted[key] = n + yielding

    def _rate(self, key: tuple[int, int]) -> None:
        """tokens/s of (bucket, budget): tokens per request-step over seconds per request-step."""
        self.rates[key] = self.tokens[key] / self.seconds[key]

    def summary(self) -> dict[str, float]:
        return {f"bs{b}-{budget_name(x)}": round(r, 1) for (b, x), r in sorted(self.rates.items())}
