"""A target in the scheduler's own process (a colocated pair; the target's own `Generate`, no draft) prefills a long
prompt one part per step (`Flights.advance`), so the running batch decodes between the parts; while a batch runs,
short prompts are prefilled at most one part's worth of tokens a step. Outputs equal those of blocking admission;
an abort, a failed part or a close mid-way release what the prompt held."""

from __future__ import annotations

import pytest
from core_engines import restored_target, tiny_draft

from draft_service.colocated import LocalTarget
from specdec.engine.generate import feature_layers_for
from specdec.engine.overlap import TwoBatchOverlap
from specdec.engine.requests import ABORT
from specdec.engine.scheduler import Scheduler
from specdec.errors import UnknownRequest
from specdec.sampling_params import SamplingParams

PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)
CHUNK = 64


@pytest.fixture
def engine():
    yield from restored_target()


def _prompts(dev_prompts, tiny_tokenizer):
    short = tiny_tokenizer.encode(dev_prompts[3])[-40:]
    long = (tiny_tokenizer.encode(dev_prompts[4]) * 4)[-200:]  # four parts of 64 (the last one of 8)
    return short, long


def _scheduler(engine, with_draft: bool, overlap: bool = False):
    draft = tiny_draft() if with_draft else None
    layers = feature_layers_for(draft) if draft is not None else ()
    wrap = TwoBatchOverlap(min_batch_size=0) if overlap else None
    return Scheduler(engine, draft, engine.max_context, 8, layers, overlap=wrap), draft


def _count_calls(monkeypatch, engine, name: str) -> list:
    """Record each call of the engine's `name` (its first argument) and pass it on."""
    calls, real = [], getattr(engine, name)

    def counted(arg):
        calls.append(arg)
        return real(arg)

    monkeypatch.setattr(engine, name, counted)
    return calls


def _reference(engine, with_draft: bool, prompts: dict) -> dict:
    """Every prompt admitted at once, each in one forward."""
    engine.prefill_chunk_tokens = 0
    sched, _ = _scheduler(engine, with_draft)
    for rid, prompt in prompts.items():
        sched.add(rid, prompt, PARAMS)
    out = {rid: [] for rid in prompts}
    while sched.has_work:
        for ev in sched.step():
            assert ev.error is None
            out[ev.request_id] += ev.tokens
    return out


def _step(sched, out: dict) -> list:
    events = sched.step()
    for ev in events:
        assert ev.error is None
        out[ev.request_id] += ev.tokens
    return events


def _assert_nothing_held(engine, draft) -> None:
    assert not engine.requests and not engine.prefilling and engine.kv.reserved_by_requests == 0
    if draft is not None:
        assert not draft.requests and draft.kv.num_free_pages == draft.kv.num_total_pages


@pytest.mark.parametrize("with_draft, overlap", [(True, False), (False, False), (True, True)],
                         ids=["colocated", "target-generate", "colocated-overlap"])
def test_the_batch_decodes_between_a_long_prompts_parts(engine, monkeypatch, dev_prompts, tiny_tokenizer,
                                                         with_draft, overlap):
    short, long = _prompts(dev_prompts, tiny_tokenizer)
    reference = _reference(engine, with_draft, {"s": short, "l": long})
    engine.prefill_chunk_tokens = CHUNK
    parts = _count_calls(monkeypatch, engine, "prefill_part")
    sched, draft = _scheduler(engine, with_draft, overlap)
    out = {"s": [], "l": []}
    sched.add("s", short, PARAMS)
    _step(sched, out)
    sched.add("l", long, PARAMS)
    _step(sched, out)  # admitted: its pages taken, its prompt not run yet
    assert sched.flights.ids() == {"l"} and "l" in engine.prefilling and not parts
    decoded = []
    for _ in range(4):  # one part a step, the batch decoding each step
        before, n = len(out["s"]), len(parts)
        _step(sched, out)
        assert len(parts) == n + 1
        decoded.append(len(out["s"]) > before)
    assert all(decoded) and not sched.flights.out and "l" in sched.running, (list(sched.running), out, sched.waiting)
    while sched.has_work:
        _step(sched, out)
    assert out == reference and len(parts) == 4
    _assert_nothing_held(engine, draft)


@pytest.mark.parametrize("with_draft", [True, False], ids=["colocated", "target-generate"])
def test_a_burst_of_short_prompts_is_prefilled_a_part_a_step(engine, monkeypatch, dev_prompts, tiny_tokenizer,
                                                              with_draft):
    """While a batch runs, one step prefills at most a part's worth of prompt tokens (one prompt of 40 here); with
    nothing running the burst is admitted together."""
    short, _ = _prompts(dev_prompts, tiny_tokenizer)
    prompts = {f"b{i}": short[i:] for i in range(4)}
    reference = _reference(engine, with_draft, {"s": short, **prompts})
    engine.prefill_chunk_tokens = CHUNK
    prefills = _count_calls(monkeypatch, engine, "prefill")
    sched, draft = _scheduler(engine, with_draft)
    out = {"s": [], **{rid: [] for rid in prompts}}
    sched.add("s", short, PARAMS)
    _step(sched, out)
    for rid, prompt in prompts.items():
        sched.add(rid, prompt, PARAMS)
    calls = len(prefills)
    while sched.has_work:
        _step(sched, out)
    during = prefills[calls:]
    assert [[inp.request_id for inp in call] for call in during] == [[rid] for rid in prompts]
    assert all(sum(len(inp.prompt_ids) for inp in call) <= CHUNK for call in during)
    assert out == reference
    _assert_nothing_held(engine, draft)


def test_an_abort_mid_prompt_releases_it_and_the_batch_goes_on(engine, dev_prompts, tiny_tokenizer):
    short, long = _prompts(dev_prompts, tiny_tokenizer)
    engine.prefill_chunk_tokens = CHUNK
    sched, draft = _scheduler(engine, True)
    out = {"s": [], "l": []}
    sched.add("s", short, PARAMS)
    _step(sched, out)
    sched.add("l", long, PARAMS)
    _step(sched, out)
    _step(sched, out)  # its first part
    sched.abort("l")
    events = sched.step()
    out["s"] += [t for ev in events if ev.request_id == "s" for t in ev.tokens]
    ended = [ev for ev in events if ev.request_id == "l"]
    # an abort, as before or after its admission: FINISH_REASON_ABORT, no error (a CANCELLED status would read as
    # the draft failing to the gateway, which continues elsewhere)
    assert [(ev.finish_reason, ev.error) for ev in ended] == [(ABORT, None)]
    assert "l" not in engine.requests and "l" not in engine.prefilling and "l" not in draft.requests
    while sched.has_work:
        _step(sched, out)
    assert len(out["s"]) == PARAMS.max_new_tokens and out["l"] == []
    _assert_nothing_held(engine, draft)


def test_a_failed_part_fails_its_request_alone(engine, monkeypatch, dev_prompts, tiny_tokenizer):
    short, long = _prompts(dev_prompts, tiny_tokenizer)
    engine.prefill_chunk_tokens = CHUNK
    real, runs = engine._run_part, []

    def second_fails(part):
        runs.append(part)
        if len(runs) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(part)

    monkeypatch.setattr(engine, "_run_part", second_fails)
    sched, draft = _scheduler(engine, True)
    sched.add("s", short, PARAMS)
    sched.add("l", long, PARAMS)  # nothing runs yet: it flies all the same, "s" starts at once
    errors, tokens = [], 0
    while sched.has_work:
        for ev in sched.step():
            if ev.error is not None:
                errors.append((ev.request_id, str(ev.error)))
            elif ev.request_id == "s":
                tokens += len(ev.tokens)
    assert errors == [("l", "prefill failed: RuntimeError('CUDA error: an illegal memory access was encountered')")]
    assert tokens == PARAMS.max_new_tokens
    _assert_nothing_held(engine, draft)


def test_close_mid_prompt_releases_it(engine, dev_prompts, tiny_tokenizer):
    short, long = _prompts(dev_prompts, tiny_tokenizer)
    engine.prefill_chunk_tokens = CHUNK
    sched, draft = _scheduler(engine, True)
    sched.add("s", short, PARAMS)
    sched.step()
    sched.add("l", long, PARAMS)
    sched.step()
    sched.step()
    assert "l" in engine.prefilling
    sched.close()
    assert not sched.flights.out and "l" not in engine.requests and "l" not in draft.requests
    sched.fail_running(UnknownRequest("stopping"))
    _assert_nothing_held(engine, draft)


def test_a_colocated_targets_part_calls_name_the_target(engine):
    local = LocalTarget(engine, "tiny")
    with pytest.raises(UnknownRequest, match="^target: request 'nope' has no prefill under way"):
        local.prefill_part("nope")
