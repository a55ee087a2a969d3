"""A prompt the target prefills in parts is admitted in the background (`Admission._in_background`): its Prefill is
sent and the running batch keeps stepping until the answer is in; then it joins. Outputs are the same as with
blocking admission; an abort while it is in flight ends it once it lands, and nothing stays held."""

from __future__ import annotations

from core_engines import tiny_draft, tiny_target

from specdec.engine.generate import feature_layers_for
from specdec.engine.requests import ABORT
from specdec.engine.scheduler import Scheduler
from specdec.errors import Cancelled
from specdec.sampling_params import SamplingParams

PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


class SendingTarget:
    """A remote target's shape: Prefill RPCs sent (`prefill_send`) and answered when the test says so."""

    prefill_chunk_tokens = 64

    def __init__(self, engine):
        self.engine, self.ready, self.sent, self.cancelled = engine, False, [], set()

    def prefill_send(self, inputs):
        self.sent.append([inp.request_id for inp in inputs])
        return list(inputs)

    def prefill_ready(self, sent):
        return self.ready

    def prefill_collect(self, sent):
        return [Cancelled("left") if inp.request_id in self.cancelled else self.engine.prefill([inp])[0]
                for inp in sent]

    def prefill_each(self, inputs):
        return self.prefill_collect(self.prefill_send(inputs))

    def cancel_prefill(self, rid):
        self.cancelled.add(rid)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _prompts(dev_prompts, tiny_tokenizer):
    short = tiny_tokenizer.encode(dev_prompts[3])[-40:]
    long = (tiny_tokenizer.encode(dev_prompts[4]) * 4)[-200:]  # longer than the target's part of 64
    return short, long


def _blocking(engine, draft, short, long) -> dict:
    """The reference: both admitted at once, blocking (no remote target)."""
    sched = Scheduler(engine, draft, engine.max_context, 8, feature_layers_for(draft))
    sched.add("s", short, PARAMS)
    sched.add("l", long, PARAMS)
    out = {"s": [], "l": []}
    while sched.has_work:
        for ev in sched.step():
            assert ev.error is None
            out[ev.request_id] += ev.tokens
    return out


def test_the_batch_steps_while_a_long_prompt_is_prefilled(dev_prompts, tiny_tokenizer):
    engine, draft = tiny_target(), tiny_draft()
    short, long = _prompts(dev_prompts, tiny_tokenizer)
    reference = _blocking(engine, draft, short, long)
    target = SendingTarget(engine)
    sched = Scheduler(target, draft, engine.max_context, 8, feature_layers_for(draft))
    out = {"s": [], "l": []}

    def step():
        for ev in sched.step():
            assert ev.error is None
            out[ev.request_id] += ev.tokens

    sched.add("s", short, PARAMS)
    step()  # nothing running: "s" is admitted the blocking way
    assert target.sent == [["s"]] and out["s"]
    sched.add("l", long, PARAMS)
    step()
    assert target.sent[-1] == ["l"] and sched.flights.ids() == {"l"} and sched.num_admitting == 1
    before = len(out["s"])
    for _ in range(3):
        step()
    assert len(out["s"]) > before and out["l"] == []  # "s" decodes while "l" is in flight
    target.ready = True
    while sched.has_work:
        step()
    assert out == reference
    assert not engine.requests and draft.kv.num_free_pages == draft.kv.num_total_pages


def _long_in_flight(dev_prompts, tiny_tokenizer):
    """(engine, draft, target, scheduler) with "s" running and "l"'s Prefill in flight."""
    engine, draft = tiny_target(), tiny_draft()
    short, long = _prompts(dev_prompts, tiny_tokenizer)
    target = SendingTarget(engine)
    sched = Scheduler(target, draft, engine.max_context, 8, feature_layers_for(draft))
    sched.add("s", short, PARAMS)
    sched.step()
    sched.add("l", long, PARAMS)
    sched.step()
    return engine, draft, target, sched


def test_an_abort_in_flight_lands_and_frees_everything(dev_prompts, tiny_tokenizer):
    engine, draft, target, sched = _long_in_flight(dev_prompts, tiny_tokenizer)
    sched.abort("l")  # kept until the admission lands (its client's leaving cancels the RPC meanwhile)
    ended = [ev for ev in sched.step() if ev.request_id == "l"]
    assert not ended and sched.aborting == {"l"}
    target.ready = True
    events = []
    while sched.has_work:
        events += sched.step()
    # ends as an abort before or after its admission does: FINISH_REASON_ABORT, no error (a CANCELLED status, which
    # the gateway reads as a failing draft and continues elsewhere, against an operator's Abort call)
    assert [(ev.finish_reason, ev.error) for ev in events if ev.request_id == "l"] == [(ABORT, None)]
    assert not engine.requests and not draft.requests
    assert engine.kv.reserved_by_requests == 0 and draft.kv.num_free_pages == draft.kv.num_total_pages


def test_close_with_a_prefill_in_flight_releases_it(dev_prompts, tiny_tokenizer):
    engine, draft, target, sched = _long_in_flight(dev_prompts, tiny_tokenizer)
    assert sched.flights.out
    sched.close()
    assert target.cancelled == {"l"} and "l" not in engine.requests and "l" not in draft.requests
    sched.fail_running(Cancelled("stopping"))
    assert not engine.requests and draft.kv.num_free_pages == draft.kv.num_total_pages


def test_short_prompts_do_not_wait_for_long_ones_in_flight(dev_prompts, tiny_tokenizer):
    """QA: short prompts admitted with long ones waited for the longest (a 5 s first token for a prompt the target
    prefilled in 0.5 s). Each admission's long prompts fly; its short ones start at once; two long prompts arriving
    apart each get a flight of their own and land in any order."""
    engine, draft, target, sched = _long_in_flight(dev_prompts, tiny_tokenizer)
    short, long = _prompts(dev_prompts, tiny_tokenizer)
    sched.add("l2", long[10:], PARAMS)
    sched.add("s2", short[5:], PARAMS)
    started = {ev.request_id for ev in sched.step()}
    assert "s2" in started and not started & {"l", "l2"}
    assert target.sent[-2:] == [["l2"], ["s2"]] and sched.flights.ids() == {"l", "l2"} and len(sched.running) == 2
    target.ready = True
    events = []
    while sched.has_work:
        events += sched.step()
    assert all(ev.error is None for ev in events) and {"l", "l2"} <= {ev.request_id for ev in events}
    assert not engine.requests and draft.kv.num_free_pages == draft.kv.num_total_pages


def test_long_prompts_admitted_together_start_each_when_answered(dev_prompts, tiny_tokenizer):
    """Each long prompt is a flight of its own: one answered first starts while the other is still in flight."""
    engine, draft, target, sched = _long_in_flight(dev_prompts, tiny_tokenizer)
    _, long = _prompts(dev_prompts, tiny_tokenizer)
    sched.add("l2", long[20:], PARAMS)
    sched.step()
    assert target.sent[-1] == ["l2"] and len(sched.flights.out) == 2
    target.prefill_ready = lambda sent: [inp.request_id for inp in sent] == ["l2"]  # "l2" answered, "l" not yet
    started = {ev.request_id for ev in sched.step()}
    assert "l2" in started and "l2" in sched.running and sched.flights.ids() == {"l"}
    target.ready = True
    del target.prefill_ready
    while sched.has_work:
        assert all(ev.error is None for ev in sched.step())
    assert not engine.requests and draft.kv.num_free_pages == draft.kv.num_total_pages
