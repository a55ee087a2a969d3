"""Two-batch overlap: the running batch split into two micro-batches that take turns (the draft proposes for one
while the target verifies the other) gives the same tokens as one synchronous step at a time; aborts and failed
verifies of a micro-batch in flight end only those requests, and no KV page is left behind."""

from __future__ import annotations

import threading
import time

from core_engines import tiny_draft, tiny_target

from specdec.engine.generate import feature_layers_for
from specdec.engine.overlap import TwoBatchOverlap, split_by_tokens
from specdec.engine.scheduler import Scheduler
from specdec.errors import SpecdecError
from specdec.sampling_params import SamplingParams


def _prompts(dev_prompts, tiny_tokenizer, n, start=60):
    return [tiny_tokenizer.encode(p)[-(24 + 9 * i):] for i, p in enumerate(dev_prompts[start:start + n])]


def _run(sched: Scheduler, prompts, params, on_step=None) -> dict:
    out = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        sched.add(f"r{i}", prompt, p)
    n = 0
    while sched.has_work:
        for ev in sched.step():
            if ev.error is not None:
                out[ev.request_id] = ev.error
            else:
                out.setdefault(ev.request_id, []).extend(ev.tokens)
        n += 1
        if on_step is not None:
            on_step(sched, n)
    sched.close()
    return out


def _all_free(*engines) -> bool:
    return all(e.kv.num_free_pages == e.kv.num_total_pages and not getattr(e, "requests", {}) for e in engines)


class SlowTarget:
    """The engine, with every verify taking at least `delay_s`; records when each verify ran and its size."""

    def __init__(self, engine, delay_s=0.03, fail_on=None):
        self.engine, self.delay_s, self.fail_on = engine, delay_s, fail_on
        self.verifies: list[tuple[float, float, int]] = []

    def verify(self, inputs):
        t0 = time.perf_counter()
        if self.fail_on is not None and any(i.request_id == self.fail_on for i in inputs):
            raise SpecdecError("injected verify failure")
        out = self.engine.verify(inputs)
        time.sleep(self.delay_s)
        self.verifies.append((t0, time.perf_counter(), len(inputs)))
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_split_by_tokens_balances_tokens_not_requests():
    assert split_by_tokens(["a", "b", "c", "d"], [10, 10, 10, 10], 0.5) == (["a", "b"], ["c", "d"])
    assert split_by_tokens(["a", "b", "c", "d"], [90, 10, 10, 10], 0.5) == (["a"], ["b", "c", "d"])
    assert split_by_tokens(["a", "b", "c"], [10, 10, 80], 0.5) == (["a", "b", "c"], [])
    assert split_by_tokens(["a"], [5], 0.0) == (["a"], [])  # at least one
    assert split_by_tokens(["a", "b"], [5, 5], 1.0) == (["a", "b"], [])


def test_overlap_is_lossless_and_the_draft_proposes_while_the_target_verifies(dev_prompts, tiny_tokenizer):
    engine = tiny_target()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 9)
    params = [SamplingParams(max_new_tokens=n) for n in (30, 12, 41, 25, 7, 33, 19, 28, 36)]
    plain = _run(Scheduler(engine, None, engine.max_context, 6), prompts, params)
    for kind in ("draft", "draft-eagle3"):
        draft = tiny_draft(kind)
        target = SlowTarget(engine)
        proposes = []
        propose = draft.propose

        def timed_propose(rids, size=None, propose=propose, proposes=proposes):
            proposes.append(time.perf_counter())
            return propose(rids, size)

        draft.propose = timed_propose
        overlap = TwoBatchOverlap(min_batch_size=4)
        # 6 running at most of 9: later requests are admitted while a micro-batch is in flight
        sched = Scheduler(target, draft, engine.max_context, 6, feature_layers_for(draft), overlap=overlap)
        assert _run(sched, prompts, params) == plain
        assert _all_free(engine, draft)
        assert overlap.micro_steps > 10
        assert min(n for _, _, n in target.verifies) < 6  # micro-batches, not the whole batch
        during = sum(any(t0 < t < t1 for t0, t1, _ in target.verifies) for t in proposes)
        assert during >= overlap.micro_steps // 2, (during, overlap.micro_steps)


def test_small_batches_step_synchronously(dev_prompts, tiny_tokenizer):
    engine, draft = tiny_target(), tiny_draft()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 3)
    params = [SamplingParams(max_new_tokens=10)] * 3
    overlap = TwoBatchOverlap(min_batch_size=4)
    out = _run(Scheduler(engine, draft, engine.max_context, 8, feature_layers_for(draft), overlap=overlap),
               prompts, params)
    assert overlap.micro_steps == 0 and all(len(t) == 10 for t in out.values())


def _overlapped_vs_plain(dev_prompts, tiny_tokenizer, n: int, new_tokens: int, target_wrapper):
    """(engine, draft, prompts, params, plain outputs, an overlapped scheduler over `target_wrapper(engine)`)."""
    engine, draft = tiny_target(), tiny_draft()
    prompts = _prompts(dev_prompts, tiny_tokenizer, n)
    params = [SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)] * n
    plain = _run(Scheduler(engine, None, engine.max_context, 8), prompts, params)
    sched = Scheduler(target_wrapper(engine), draft, engine.max_context, 8, feature_layers_for(draft),
                      overlap=TwoBatchOverlap(min_batch_size=2))
    return engine, draft, prompts, params, plain, sched


def test_abort_of_a_request_in_flight_lands_first_and_frees_its_pages(dev_prompts, tiny_tokenizer):
    engine, draft, prompts, params, plain, sched = _overlapped_vs_plain(
        dev_prompts, tiny_tokenizer, 6, 30, lambda e: SlowTarget(e, 0.01))
    overlap = sched.overlap
    aborted = []

    def abort_in_flight(s, n):
        if n == 3:
            rid = sorted(overlap.busy(s))[0]
            aborted.append(rid)
            s.abort(rid)

    out = _run(sched, prompts, params, abort_in_flight)
    (rid,) = aborted
    assert out[rid] == plain[rid][:len(out[rid])] and len(out[rid]) < 30
    assert {r: t for r, t in out.items() if r != rid} == {r: t for r, t in plain.items() if r != rid}
    assert _all_free(engine, draft)


def test_a_failed_verify_ends_only_its_micro_batch(dev_prompts, tiny_tokenizer):
    engine, draft, prompts, params, plain, sched = _overlapped_vs_plain(
        dev_prompts, tiny_tokenizer, 8, 20, lambda e: SlowTarget(e, 0.0, fail_on="r0"))
    out = _run(sched, prompts, params)
    failed = {r for r, v in out.items() if isinstance(v, SpecdecError)}
    assert "r0" in failed and 0 < len(failed) < 8  # r0's micro-batch, not the other one
    assert all(out[r] == plain[r] for r in out if r not in failed)
    assert _all_free(engine, draft)


def test_seeded_sampling_draws_the_same_with_and_without_overlap(dev_prompts, tiny_tokenizer):
    engine = tiny_target()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 6)
    params = [SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, seed=100 + i) for i in range(6)]
    runs = []
    for overlap in (None, TwoBatchOverlap(min_batch_size=2)):
        draft = tiny_draft()
        runs.append(_run(Scheduler(engine, draft, engine.max_context, 8, feature_layers_for(draft),
                                   overlap=overlap), prompts, params))
        assert _all_free(engine, draft)
    assert runs[0] == runs[1]


def test_the_verify_worker_runs_beside_the_scheduler_thread(dev_prompts, tiny_tokenizer):
    """While the batch is big enough the verify call leaves the scheduler's thread (so the draft's work is not
    behind it); a tail below `min_batch_size` (one request left) steps on the scheduler's thread."""
    engine, draft = tiny_target(), tiny_draft()
    calls = []  # (thread name, running requests when the verify was made)
    sched = None

    class Recording(SlowTarget):
        def verify(self, inputs):
            calls.append((threading.current_thread().name, len(sched.running)))
            return super().verify(inputs)

    prompts = _prompts(dev_prompts, tiny_tokenizer, 4)
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True)] * 4
    sched = Scheduler(Recording(engine, 0.0), draft, engine.max_context, 8, feature_layers_for(draft),
                      overlap=TwoBatchOverlap(min_batch_size=2))
    _run(sched, prompts, params)
    # (a worker's count may already see the other micro-batch landed; the scheduler thread's cannot race)
    assert sum(t.startswith("specdec-verify") for t, _ in calls) >= len(calls) // 2
    assert all(n < 2 for t, n in calls if not t.startswith("specdec-verify"))


def test_plain_calls_are_short_while_micro_batches_take_turns():
    """A draft asking for 16 plain steps per call asks for PLAIN_STEPS for one micro-batch of two: a long plain
    call of it would hold the target while the other's verify waits. Plain calls of the whole batch ramp up to 16
    after an admission (4, 8, 16: requests arriving meanwhile join sooner), or take 16 at once when the batch is
    full (no one could join)."""
    from specdec.engine.plain_steps import PLAIN_STEPS

    class Remote:
        concurrent_calls = True

    sched = Scheduler(Remote(), None, 2048, 64, overlap=TwoBatchOverlap(4), plain_steps=16)
    try:
        sched.running = {f"r{i}": None for i in range(4)}
        assert [sched._plain_steps_per_call(micro=False) for _ in range(4)] == [PLAIN_STEPS, 8, 16, 16]
        assert sched._plain_steps_per_call(micro=True) == PLAIN_STEPS
        sched.max_batch_size = 4
        sched._plain_ramp = PLAIN_STEPS
        assert sched._plain_steps_per_call(micro=False) == 16
    finally:
        sched.close()


def test_a_plain_choice_decodes_the_whole_batch_in_one_call(dev_prompts, tiny_tokenizer):
    """When a micro-batch's budget comes out plain, what is in flight lands and the whole running batch decodes
    plainly in one call of the scheduler's plain steps (two half-batches cost the target more, and the draft has
    nothing to overlap). Speculative choices still go out as micro-batches; the policy chooses and files both under
    the running batch's bucket; the tokens are plain decoding's."""
    from specdec.engine.adaptive import FULL, SpeculationPolicy

    engine = tiny_target()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 8)
    params = [SamplingParams(max_new_tokens=24, ignore_eos=True)] * 8
    plain = _run(Scheduler(engine, None, engine.max_context, 8), prompts, params)

    class Target(SlowTarget):
        def verify(self, inputs, plain_steps=1, feature_rows=0):
            self.verifies.append((0.0, 0.0, len(inputs), plain_steps, bool(inputs[0].draft_tokens)))
            return self.engine.verify(inputs, plain_steps=plain_steps, feature_rows=feature_rows)

    class Policy(SpeculationPolicy):
        def choose(self, batch_size):
            self.turn[0] = self.turn.get(0, 0) + 1
            return (FULL, FULL, 0)[self.turn[0] % 3]

    draft, target, policy = tiny_draft(), Target(engine, 0.0), Policy(history=[])
    sched = Scheduler(target, draft, engine.max_context, 8, feature_layers_for(draft), policy=policy,
                      overlap=TwoBatchOverlap(min_batch_size=4), plain_steps=8)
    assert _run(sched, prompts, params) == plain
    assert _all_free(engine, draft)
    plain_calls = [(n, k) for _, _, n, k, drafted in target.verifies if not drafted and k > 1]
    spec_calls = [n for _, _, n, _, drafted in target.verifies if drafted]
    assert plain_calls and spec_calls
    assert all(k == 8 for _, k in plain_calls)  # the whole batch (or what is left of it): the scheduler's plain steps
    assert max(n for n, _ in plain_calls) == 8 and max(spec_calls) < 8  # whole batch vs micro-batches
    whole = [h for h in policy.history if h[0] == "step" and h[2] == 0 and h[1] == 8]  # plain, all 8 requests
    micro = [h for h in policy.history if h[0] == "step" and h[2] != 0 and h[1] < 8]  # speculative micro-batches
    assert whole and micro and all(h[7] == 8 for h in whole)  # chosen for (and filed under) the running batch,
    # a micro-batch's speculative steps too, not under their own size (the last few requests run alone)
    assert any(h[7] > h[1] for h in micro) and all(h[7] >= h[1] for h in micro)


def test_seeded_requests_keep_their_draws_when_the_rest_of_the_batch_decodes_plainly(dev_prompts, tiny_tokenizer):
    """Seeded sampling stays on the whole tree (its draws depend on the trees). A micro-batch without seeded
    requests whose budget comes out plain must not pull the seeded ones of the other into a whole-batch plain
    call: their tokens are those of speculation every step."""
    from specdec.engine.adaptive import SpeculationPolicy

    class Plain(SpeculationPolicy):
        def choose(self, batch_size):
            return 0

    engine = tiny_target()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 6)
    params = [SamplingParams(max_new_tokens=20, temperature=0.8, seed=7 + i) if i >= 4 else
              SamplingParams(max_new_tokens=20) for i in range(6)]
    runs = []
    for policy, overlap in ((None, None), (Plain(), TwoBatchOverlap(min_batch_size=2))):
        draft = tiny_draft()
        runs.append(_run(Scheduler(engine, draft, engine.max_context, 8, feature_layers_for(draft), policy=policy,
                                   overlap=overlap), prompts, params))
        assert _all_free(engine, draft)
    assert runs[0] == runs[1]
