"""Requests finishing inside an accepted run: nothing after the finishing token, state and KV released."""

from __future__ import annotations

import pytest
from core_engines import tiny_draft, tiny_target

from specdec.engine.generate import generate
from specdec.engine.requests import ABORT, LENGTH, STOP
from specdec.engine.scheduler import Scheduler
from specdec.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def prompts(dev_prompts, tiny_tokenizer):
    return [tiny_tokenizer.encode(p)[-96:] for p in dev_prompts[10:14]]


@pytest.fixture(scope="module")
def reference(prompts):
    return generate(tiny_target(), None, prompts, SamplingParams(max_new_tokens=32), max_batch_size=4)


def _assert_pools_whole(target, draft):
    assert target.kv.num_free_pages == target.kv.num_total_pages and not target.requests
    assert draft.kv.num_free_pages == draft.kv.num_total_pages and not draft.requests and draft._reserved == 0


def test_max_new_tokens_crossed_inside_a_run(prompts, reference):
    """Different limits in one batch: each request stops exactly at its limit while the others go on."""
    target, draft = tiny_target(), tiny_draft()
    limits = [1, 2, 7, 13]
    params = [SamplingParams(max_new_tokens=n) for n in limits]
    out = generate(target, draft, prompts, params, max_batch_size=4)
    for r, ref, n in zip(out, reference, limits, strict=True):
        assert r.tokens == ref.tokens[:n] and r.finish_reason == LENGTH
    _assert_pools_whole(target, draft)


def _first_seen_inside_a_run(out) -> int | None:
    """Index of a token that a verify step committed after another token of the same step (inside an accepted run,
    not its first) and that occurs there for the first time in the output; None if no step committed such a run."""
    start = len(out.tokens) - sum(out.accept_lengths)  # before the verify steps: the prefill's token
    for n in out.accept_lengths:
        for i in range(start + 1, start + n):
            if out.tokens.index(out.tokens[i]) == i:
                return i
        start += n
    return None


def test_stop_token_inside_accepted_run(prompts, reference):
    """A stop id (treated like EOS) that first occurs mid-generation ends the request right after it, also when it
    sits inside a run of tokens one verify step accepted (stop ids are chosen there, from a speculative run
    without them: greedy, so the same tokens and steps up to the stop)."""
    target, draft = tiny_target(), tiny_draft()
    free = generate(target, draft, prompts, SamplingParams(max_new_tokens=32), max_batch_size=4)
    cases = []
    for prompt, ref, run in zip(prompts, reference, free, strict=True):
        assert run.tokens == ref.tokens
        inside = _first_seen_inside_a_run(run)
        stop = ref.tokens[inside if inside is not None else len(ref.tokens) // 2]
        cases.append((prompt, stop, ref.tokens[: ref.tokens.index(stop) + 1]))
    params = [SamplingParams(max_new_tokens=32, stop_token_ids=(stop,)) for _, stop, _ in cases]
    out = generate(target, draft, [c[0] for c in cases], params, max_batch_size=4)
    mid_run = 0
    for r, (_, _, expected) in zip(out, cases, strict=True):
        assert r.tokens == expected and r.finish_reason == STOP
        mid_run += any(n > 1 for n in r.accept_lengths[-1:])  # the final step committed a run
    assert mid_run >= 1
    _assert_pools_whole(target, draft)


def test_eos_ends_request_unless_ignored(prompts):
    target, draft = tiny_target(), tiny_draft()
    eos = target.eos_ids[0]
    # the model's greedy text on a prompt that closes a file soon reaches EOS; make EOS the likely next token
    prompt = prompts[0] + [eos]
    out = generate(target, draft, [prompt], SamplingParams(max_new_tokens=64))[0]
    if eos in out.tokens:
        assert out.tokens[-1] == eos and out.finish_reason == STOP
    ignored = generate(target, draft, [prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    assert len(ignored.tokens) == 20 and ignored.finish_reason == LENGTH
    _assert_pools_whole(target, draft)


def test_abort_mid_generation_frees_everything(prompts):
    target, draft = tiny_target(), tiny_draft()
    sched = Scheduler(target, draft, target.max_context, 4)
    for i, p in enumerate(prompts):
        sched.add(f"r{i}", p, SamplingParams(max_new_tokens=32))
    sched.step()
    sched.step()
    sched.abort("r1")
    sched.abort("r3")
    events = sched.step()
    aborted = {e.request_id for e in events if e.finish_reason == ABORT}
    assert aborted == {"r1", "r3"}
    assert set(sched.running) == {"r0", "r2"} and set(draft.requests) == {"r0", "r2"}
    while sched.has_work:
        sched.step()
    _assert_pools_whole(target, draft)


def test_a_request_that_ends_in_its_first_step_keeps_its_counters(prompts):
    """Admitted and finished within one scheduler step, a request is in `running` neither before the step nor after
    it: its verify steps and accepted positions were lost (accept-eval read tau 0.0 and 0 target steps at
    --max-new-tokens 3, while its histogram held the step: QA). The scheduler's `ended` keeps them for the step."""
    out = generate(tiny_target(), tiny_draft(), prompts[:1], SamplingParams(max_new_tokens=3), max_batch_size=4)[0]
    assert out.finish_reason == LENGTH and len(out.tokens) == 3
    assert out.num_verify_steps == len(out.accept_lengths) >= 1
    assert out.num_draft_tokens > 0  # its step verified drafts, counted
