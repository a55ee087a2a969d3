"""Admission prefills waiting requests together (one target call per group), and a failing request in a group
is isolated: it alone gets the error, the others run, nothing stays admitted or leaks."""

from __future__ import annotations

from core_engines import tiny_draft, tiny_target

from specdec.engine import admission as admission_module
from specdec.engine.generate import feature_layers_for
from specdec.engine.scheduler import Scheduler
from specdec.sampling_params import SamplingParams


class CountingTarget:
    """The engine, with the size of every prefill call recorded."""

    def __init__(self, engine):
        self.engine, self.prefill_sizes = engine, []

    def prefill(self, inputs):
        self.prefill_sizes.append(len(inputs))
        return self.engine.prefill(inputs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _run(sched: Scheduler, prompts, params) -> dict:
    out = {}
    for i, prompt in enumerate(prompts):
        sched.add(f"a{i}", prompt, params)
    while sched.has_work:
        for ev in sched.step():
            out.setdefault(ev.request_id, []).extend(ev.tokens)
            if ev.error is not None:
                out[ev.request_id] = ev.error
    return out


def _prompts(dev_prompts, tiny_tokenizer, n):
    return [tiny_tokenizer.encode(p)[-(30 + 5 * i):] for i, p in enumerate(dev_prompts[50:50 + n])]


def _one_at_a_time(engine, draft, prompts, params) -> dict:
    """The reference: a batch of one, so every request is admitted alone."""
    return _run(Scheduler(CountingTarget(engine), draft, engine.max_context, 1, feature_layers_for(draft)),
                prompts, params)


def test_waiting_requests_are_prefilled_together_with_the_same_output(dev_prompts, tiny_tokenizer, monkeypatch):
    engine = tiny_target()
    draft = tiny_draft()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 6)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    one_by_one = _one_at_a_time(engine, draft, prompts, params)
    target = CountingTarget(engine)
    together = _run(Scheduler(target, draft, engine.max_context, 8, feature_layers_for(draft)), prompts, params)
    assert target.prefill_sizes == [6]
    assert together == one_by_one
    monkeypatch.setattr(admission_module, "MAX_PREFILL_TOKENS", 100)  # groups split by prompt tokens
    target = CountingTarget(engine)
    assert _run(Scheduler(target, draft, engine.max_context, 8, feature_layers_for(draft)), prompts, params) == \
        one_by_one
    assert sum(target.prefill_sizes) == 6 and max(target.prefill_sizes) < 6
    assert engine.kv.num_free_pages == engine.kv.num_total_pages and not draft.requests


def test_a_bad_request_in_a_group_fails_alone(dev_prompts, tiny_tokenizer):
    engine = tiny_target()
    draft = tiny_draft()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 4)
    prompts[2] = prompts[2][:5] + [engine.cfg.vocab_size + 7]  # outside the vocabulary
    target = CountingTarget(engine)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    out = _run(Scheduler(target, draft, engine.max_context, 8, feature_layers_for(draft)), prompts, params)
    assert target.prefill_sizes[0] == 4  # tried together, then one by one
    assert "outside the vocabulary" in str(out["a2"])
    assert all(len(out[f"a{i}"]) == 8 for i in (0, 1, 3))
    assert engine.kv.num_free_pages == engine.kv.num_total_pages and not engine.requests
    assert draft.kv.num_free_pages == draft.kv.num_total_pages and not draft.requests


def test_a_group_refused_for_an_id_another_caller_holds_leaves_that_callers_request_alone(dev_prompts,
                                                                                       tiny_tokenizer):
    """The target's own plain Generate admits a group whose id a draft already holds on the same target (clients
    reusing an id at once): the group is refused as a whole, then each runs alone (that one ALREADY_EXISTS).
    The draft's request keeps its state. Before, undoing the group released every id in it on the target, the
    draft's request among them, whose next Verify then failed NOT_FOUND (seen with ids reused under deadlines)."""
    from specdec.engine.requests import PrefillInput

    engine = tiny_target()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 2)
    engine.prefill([PrefillInput("a0", prompts[0], SamplingParams(max_new_tokens=8), return_features=False)])
    target = CountingTarget(engine)
    sched = Scheduler(target, None, engine.max_context, 8)
    for i, prompt in enumerate(prompts):  # "a0" is the draft's id too
        sched.add(f"a{i}", prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))
    out = {}
    while sched.has_work:
        for ev in sched.step():
            out[ev.request_id] = ev.error if ev.error is not None else out.get(ev.request_id, []) + ev.tokens
    assert target.prefill_sizes[0] == 2  # tried together, then one by one
    assert "already" in str(out["a0"]) and len(out["a1"]) == 8
    assert list(engine.requests) == ["a0"]  # the draft's request is still there
    engine.release("a0")
    assert engine.kv.num_free_pages == engine.kv.num_total_pages


class EachTarget(CountingTarget):
    """A remote target's shape: `prefill_each` answers every request alone (an output or its error), as the
    draft's gRPC client does; `refuse` maps request ids to the error the target gives them."""

    def __init__(self, engine, refuse=None):
        super().__init__(engine)
        self.refuse, self.each_sizes, self.released = dict(refuse or {}), [], []

    def prefill_each(self, inputs):
        self.each_sizes.append(len(inputs))
        answers = []
        for inp in inputs:
            error = self.refuse.pop(inp.request_id, None)
            answers.append(error if error is not None else self.engine.prefill([inp])[0])
        return answers

    def release(self, rid):
        self.released.append(rid)
        self.engine.release(rid)


def test_a_remote_targets_answers_are_taken_one_by_one(dev_prompts, tiny_tokenizer):
    """A group's Prefills go out together; a request the target refuses fails alone; one that must wait for KV
    pages waits with every request behind it (FIFO; what the target admitted for those is released), then all
    finish with the same tokens as when admitted one at a time."""
    from specdec.errors import InvalidInput, OutOfPages

    engine = tiny_target()
    draft = tiny_draft()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 5)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    alone = _one_at_a_time(engine, draft, prompts, params)
    target = EachTarget(engine, {"a1": InvalidInput("bad prompt"), "a2": OutOfPages("KV pool full")})
    sched = Scheduler(target, draft, engine.max_context, 8, feature_layers_for(draft), max_queue_wait_s=30.0)
    out = _run(sched, prompts, params)
    assert target.each_sizes[0] == 5 and target.prefill_sizes == []  # never the all-or-nothing call
    assert "bad prompt" in str(out["a1"])
    assert set(target.released) >= {"a3", "a4"}  # admitted behind the waiting a2: released, admitted again
    assert {k: v for k, v in out.items() if k != "a1"} == {k: v for k, v in alone.items() if k != "a1"}
    assert engine.kv.num_free_pages == engine.kv.num_total_pages and not engine.requests
    assert draft.kv.num_free_pages == draft.kv.num_total_pages and not draft.requests


def test_admission_time_counts_only_steps_that_admit():
    """`timings.admit_s` (the draft's `step_phase_seconds{phase="admit"}`) grows at the step that admits a
    request, not at every decode step with nothing to admit (QA: 8 of 9 observations were those, under 100 us)."""
    engine = tiny_target()
    draft = tiny_draft()
    sched = Scheduler(engine, draft, engine.max_context, 8, feature_layers_for(draft))
    sched.add("r0", list(range(300, 340)), SamplingParams(max_new_tokens=30, ignore_eos=True))
    sched.step()  # admits r0 (and decodes it)
    admitted = sched.timings.admit_s
    assert admitted > 0
    for _ in range(3):
        sched.step()
    assert sched.timings.admit_s == admitted
    while sched.has_work:
        sched.step()


def test_a_steps_admissions_go_out_before_its_decode(dev_prompts, tiny_tokenizer):
    """`before_decode` (the engine loop's delivery) gets the admitted requests' first tokens before the step's decode
    runs, and the step returns only the decode's events: a request's first token is streamed a step sooner. Without
    it, everything comes back together, as before."""
    target, draft = tiny_target(), tiny_draft()
    prompts = [tiny_tokenizer.encode(p)[-60:] for p in dev_prompts[30:32]]
    for hooked in (True, False):
        sched = Scheduler(target, draft, target.max_context, 4, feature_layers_for(draft))
        early, decoded_when_early = [], []
        if hooked:
            def hand_out(evs, early=early, seen=decoded_when_early, sched=sched):
                early.extend(evs)
                seen.append(sched.timings.spec_steps)

            sched.before_decode = hand_out
        for i, p in enumerate(prompts):
            sched.add(f"d{i}", p, SamplingParams(max_new_tokens=12))
        returned = sched.step()
        if hooked:
            assert [e.request_id for e in early] == ["d0", "d1"] and all(len(e.tokens) == 1 for e in early)
            assert decoded_when_early == [0]  # handed out before the step's decode ran
            assert all(e.from_verify for e in returned) and len(returned) == 2
        else:
            assert [e.from_verify for e in returned] == [False, False, True, True]
        for i in range(len(prompts)):
            sched.abort(f"d{i}")
        while sched.has_work:
            sched.step()


def test_requests_under_admission_are_counted_as_waiting(dev_prompts, tiny_tokenizer):
    """While a group's prefill is under way its requests are neither queued nor running: the draft's gauges showed
    3 running and 0 waiting while 30 prompts were being prefilled (QA). `admitting` holds them until they start."""
    engine = tiny_target()
    draft = tiny_draft()
    seen = []

    class WatchingTarget(CountingTarget):
        def prefill(self, inputs):
            seen.append((len(sched.waiting), len(sched.admitting), len(sched.running)))
            return super().prefill(inputs)

    sched = Scheduler(WatchingTarget(engine), draft, engine.max_context, 8, feature_layers_for(draft))
    out = _run(sched, _prompts(dev_prompts, tiny_tokenizer, 5), SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert seen == [(0, 5, 0)] and len(out) == 5
    assert sched.admitting == [] and not sched.waiting and not sched.running


def test_a_request_whose_client_left_during_an_earlier_groups_prefill_is_not_prefilled(dev_prompts, tiny_tokenizer,
                                                                                         monkeypatch):
    """One admission prefills its groups one after another; a client that leaves during one has its abort queued
    behind the whole admission. The engine loop marks it left at once (`Scheduler.left`): the next group does not
    take it (QA: 74 of 80 long prompts were prefilled after their clients had left, short requests waiting 37 s
    behind them)."""
    engine, draft = tiny_target(), tiny_draft()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 3)
    monkeypatch.setattr(admission_module, "MAX_PREFILL_TOKENS", 40)  # a group each
    sched = Scheduler(None, draft, engine.max_context, 8, feature_layers_for(draft))

    class LeavingTarget(CountingTarget):
        def prefill(self, inputs):
            sched.left.add("a2")  # its client leaves while the first group is prefilled
            self.prefilled = [*getattr(self, "prefilled", []), *(i.request_id for i in inputs)]
            return super().prefill(inputs)

    sched.target = target = LeavingTarget(engine)
    out = _run(sched, prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert target.prefilled == ["a0", "a1"] and out["a2"] == []
    assert len(out["a0"]) == 4 and len(out["a1"]) == 4
    assert not engine.requests and engine.kv.num_free_pages == engine.kv.num_total_pages
