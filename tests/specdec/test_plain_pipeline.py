"""Pipelined plain calls (`TwoBatchOverlap.plain_in_flight`): while the whole batch decodes plainly, the next call
goes out before the previous one's reply. Same tokens and finish reasons as plain decoding one call at a time,
also when a call finishes a request (stop token, length) that the next call already names, when speculation
resumes between plain stretches, and when a request is aborted mid-pipeline; no KV page is left behind."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from core_engines import tiny_draft, tiny_target

from specdec.engine.adaptive import FULL, SpeculationPolicy
from specdec.engine.generate import feature_layers_for
from specdec.engine.overlap import TwoBatchOverlap
from specdec.engine.requests import ABORT, PrefillInput, VerifyInput
from specdec.engine.scheduler import Scheduler
from specdec.errors import InvalidInput, NotReady, OutOfOrder
from specdec.sampling_params import SamplingParams


class OrderedTarget:
    """Stands for the draft's gRPC client: `verify_start` sends without waiting and calls run in the order sent
    (one worker), each taking at least `delay_s`. Records every verify (request ids, plain steps), the most calls
    sent and not yet answered, and the results that came back empty (a request an earlier call finished)."""

    concurrent_calls = True

    def __init__(self, engine, delay_s: float = 0.005):
        self.engine, self.delay_s = engine, delay_s
        self._pool = ThreadPoolExecutor(1)
        self._lock = threading.Lock()  # the engine is not thread-safe: prefill/release beside a running verify
        self.calls: list[tuple[list[str], int]] = []
        self.pending = self.most_pending = 0
        self.empty: list[str] = []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def verify_start(self, inputs, plain_steps=1, feature_rows=0):
        self._record(inputs, plain_steps)
        return self._pool.submit(self._run, inputs, plain_steps, feature_rows)

    def _record(self, inputs, plain_steps) -> None:
        with self._lock:
            self.pending += 1
            self.most_pending = max(self.most_pending, self.pending)
            self.calls.append(([i.request_id for i in inputs], plain_steps))

    def _run(self, inputs, plain_steps, feature_rows):
        time.sleep(self.delay_s)
        with self._lock:
            try:
                out = self.engine.verify(inputs, plain_steps=plain_steps, feature_rows=feature_rows)
            finally:
                self.pending -= 1
        self.empty += [o.request_id for o in out if not o.tokens]
        return out

    def verify_finish(self, future):
        return future.result()

    def verify(self, inputs, **kwargs):
        return self.verify_finish(self.verify_start(inputs, **kwargs))

    def prefill(self, inputs):
        with self._lock:
            return self.engine.prefill(inputs)

    def release(self, request_id):
        with self._lock:
            return self.engine.release(request_id)


class OvertakingTarget(OrderedTarget):
    """Like `OrderedTarget`, but of two calls sent back to back the second runs first, as two unary calls in flight
    may reach a gRPC server's handlers: a plain call waits (up to `hold_s`) for the next call to run before it."""

    def __init__(self, engine, hold_s: float = 0.2):
        super().__init__(engine, delay_s=0.0)
        self._pool = ThreadPoolExecutor(2)
        self.hold_s = hold_s
        self._held: threading.Event | None = None
        self.overtaken = 0  # calls that ran after the call sent behind them

    def verify_start(self, inputs, plain_steps=1, feature_rows=0):
        with self._lock:
            held, self._held = self._held, None
            wait = self._held = threading.Event() if held is None and plain_steps > 1 else None
        self._record(inputs, plain_steps)
        return self._pool.submit(self._run_after, wait, held, inputs, plain_steps, feature_rows)

    def _run_after(self, wait, release, inputs, plain_steps, feature_rows):
        if wait is not None and wait.wait(self.hold_s):
            self.overtaken += 1
        try:
            return self._run(inputs, plain_steps, feature_rows)
        finally:
            if release is not None:
                release.set()


class Plain(SpeculationPolicy):
    def choose(self, batch_size):
        return 0


def _prompts(dev_prompts, tiny_tokenizer, n):
    return [tiny_tokenizer.encode(p)[-(20 + 7 * i):] for i, p in enumerate(dev_prompts[30:30 + n])]


def _run(sched: Scheduler, prompts, params, on_step=None) -> dict:
    """request id -> (tokens, finish reason)."""
    out: dict[str, tuple[list[int], str]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        sched.add(f"r{i}", prompt, p)
    n = 0
    while sched.has_work:
        for ev in sched.step():
            tokens, _ = out.get(ev.request_id, ([], ""))
            out[ev.request_id] = (tokens + ev.tokens, ev.finish_reason)
        n += 1
        if on_step is not None:
            on_step(sched, n)
    sched.close()
    return out


def _free(*engines) -> bool:
    return all(e.kv.num_free_pages == e.kv.num_total_pages and not e.requests for e in engines)


def _with_stops(engine, prompts, lengths):
    """Plain decoding's result, then params whose stop tokens end some requests inside a plain call."""
    params = [SamplingParams(max_new_tokens=n) for n in lengths]
    ref = _run(Scheduler(engine, None, engine.max_context, 8), prompts, params)
    for i in (1, 3):  # a stop token met a few tokens in: inside the first or second call of 8
        tokens = ref[f"r{i}"][0]
        # a token's first occurrence from position 5 + 4i on, else the latest before it (a looping output)
        firsts = [p for p in range(1, len(tokens)) if tokens[p] not in tokens[:p]]
        stop = tokens[next((p for p in firsts if p >= 5 + 4 * i), firsts[-1])]
        params[i] = SamplingParams(max_new_tokens=lengths[i], stop_token_ids=(stop,))
    return params, _run(Scheduler(engine, None, engine.max_context, 8), prompts, params)


def test_pipelined_plain_calls_give_plain_decodings_tokens_and_finish_reasons(dev_prompts, tiny_tokenizer):
    engine = tiny_target()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 5)
    params, ref = _with_stops(engine, prompts, [40, 37, 9, 30, 25])
    assert {reason for _, reason in ref.values()} == {"stop", "length"}
    for draft in (None, tiny_draft()):  # `--speculation off`; auto choosing plain decoding
        target = OrderedTarget(engine)
        sched = Scheduler(target, draft, engine.max_context, 8, feature_layers_for(draft) if draft else (),
                          policy=Plain(budgets=(0, FULL)) if draft else None, plain_steps=8,
                          overlap=TwoBatchOverlap(0))
        assert _run(sched, prompts, params) == ref
        assert target.most_pending == 2  # the next call went out before the previous one's reply
        assert all(k > 1 for _, k in target.calls)
        assert target.empty  # a call named a request that the call before it finished at a stop token
        assert _free(engine) and (draft is None or _free(draft))


def test_a_call_that_overtakes_the_one_sent_before_it_is_refused_and_sent_again(dev_prompts, tiny_tokenizer):
    """The target refuses (ABORTED, nothing committed) a call that continues its requests from tokens not yet
    committed; the draft sends it again once the call ahead of it has landed. Without the check the second call's
    tokens came back first (a text with 4-token chunks swapped, seen once through the services)."""
    engine = tiny_target()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 5)
    params, ref = _with_stops(engine, prompts, [40, 37, 9, 30, 25])
    for draft in (None, tiny_draft()):
        target = OvertakingTarget(engine)
        sched = Scheduler(target, draft, engine.max_context, 8, feature_layers_for(draft) if draft else (),
                          policy=Plain(budgets=(0, FULL)) if draft else None, plain_steps=8,
                          overlap=TwoBatchOverlap(0))
        assert _run(sched, prompts, params) == ref
        assert target.overtaken >= 2  # calls did run out of order, and each time the output stayed right
        assert _free(engine) and (draft is None or _free(draft))


def test_the_target_refuses_a_call_that_continues_from_another_point(dev_prompts, tiny_tokenizer):
    engine = tiny_target()
    prompt = _prompts(dev_prompts, tiny_tokenizer, 1)[0]
    engine.prefill([PrefillInput("r", prompt, SamplingParams(max_new_tokens=30), return_features=False)])
    ahead = [VerifyInput("r", [], [], num_generated=5)]  # the call after a 4-step call that has not run yet
    with pytest.raises(OutOfOrder, match="has generated 1 tokens; the call continues from 5"):
        engine.verify(ahead, plain_steps=4)
    assert engine.requests["r"].num_generated == 1  # nothing committed
    assert len(engine.verify([VerifyInput("r", [], [], num_generated=1)], plain_steps=4)[0].tokens) == 4
    assert len(engine.verify(ahead, plain_steps=4)[0].tokens) == 4  # its turn now
    # counts no call can carry are bad input, not a call to send again (QA: ABORTED, which the draft resends)
    for bad, says in ((-5, "is negative"), (10**6, "past anything it can reach")):
        with pytest.raises(InvalidInput, match=says):
            engine.verify([VerifyInput("r", [], [], num_generated=bad)], plain_steps=4)
    assert engine.requests["r"].num_generated == 9  # nothing committed
    engine.release("r")


def test_one_call_in_flight_when_asked(dev_prompts, tiny_tokenizer):
    engine = tiny_target()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 3)
    params = [SamplingParams(max_new_tokens=30, ignore_eos=True)] * 3
    ref = _run(Scheduler(engine, None, engine.max_context, 8), prompts, params)
    target = OrderedTarget(engine)
    sched = Scheduler(target, None, engine.max_context, 8, overlap=TwoBatchOverlap(0, plain_in_flight=1))
    assert _run(sched, prompts, params) == ref and target.most_pending == 1 and _free(engine)


def test_speculation_resumes_after_the_calls_in_flight_land(dev_prompts, tiny_tokenizer):
    """A policy alternating plain stretches and speculative steps: each speculative step starts once every plain
    call in flight has landed (the draft proposes from the latest tokens); greedy output stays the target's."""
    engine, draft = tiny_target(), tiny_draft()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 4)
    params, ref = _with_stops(engine, prompts, [60, 50, 45, 40])

    class Alternating(SpeculationPolicy):
        def choose(self, batch_size):
            self.turn[0] = self.turn.get(0, 0) + 1
            return 0 if self.turn[0] % 5 < 3 else FULL

    target = OrderedTarget(engine)
    calls_at_propose = []
    propose = draft.propose

    def checked_propose(rids, size=None):
        calls_at_propose.append(target.pending)
        return propose(rids, size)

    draft.propose = checked_propose
    sched = Scheduler(target, draft, engine.max_context, 8, feature_layers_for(draft),
                      policy=Alternating(budgets=(0, FULL)), plain_steps=4, overlap=TwoBatchOverlap(0))
    assert _run(sched, prompts, params) == ref
    assert calls_at_propose and all(n == 0 for n in calls_at_propose)
    assert target.most_pending == 2 and any(k == 1 for _, k in target.calls)  # both kinds of step ran
    assert _free(engine, draft)


def test_a_request_aborted_mid_pipeline_leaves_the_next_calls_and_frees_its_pages(dev_prompts, tiny_tokenizer):
    engine = tiny_target()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 4)
    params = [SamplingParams(max_new_tokens=48, ignore_eos=True)] * 4
    ref = _run(Scheduler(engine, None, engine.max_context, 8), prompts, params)
    target = OrderedTarget(engine, delay_s=0.01)
    sched = Scheduler(target, None, engine.max_context, 8, plain_steps=4, overlap=TwoBatchOverlap(0))
    aborted_at = []

    def abort(s, n):
        if n == 4:
            aborted_at.append(len(target.calls))
            s.abort("r1")

    out = _run(sched, prompts, params, abort)
    tokens, reason = out["r1"]
    assert reason == ABORT and 0 < len(tokens) < 48 and tokens == ref["r1"][0][: len(tokens)]
    assert {r: v for r, v in out.items() if r != "r1"} == {r: v for r, v in ref.items() if r != "r1"}
    later = [rids for rids, _ in target.calls[aborted_at[0]:]]
    assert later and all("r1" not in rids for rids in later[1:])  # at most the call being sent still named it
    assert _free(engine)


def test_an_admission_between_landings_is_not_a_steps_time(dev_prompts, tiny_tokenizer):
    """Requests admitted while plain calls are in flight: the policy never reads the admission (a slow prefill
    here, 0.6 s) as decoding time. An interval that was mostly admission is not recorded; a short one is taken out
    (seen through the services: a whole-chain micro-step read as 195 ms with an admission in it, 10-20 ms
    steady)."""
    engine, draft = tiny_target(), tiny_draft()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 3)
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True)] * 3

    class SlowPrefill(OrderedTarget):
        def prefill(self, inputs):
            if any(i.request_id == "late" for i in inputs):
                time.sleep(0.6)
            return super().prefill(inputs)

    target = SlowPrefill(engine, delay_s=0.01)
    policy = Plain(budgets=(0, FULL), history=[])
    sched = Scheduler(target, draft, engine.max_context, 8, feature_layers_for(draft), policy=policy,
                      plain_steps=4, overlap=TwoBatchOverlap(0))

    def late_arrival(s, n):
        if n == 3:
            s.add("late", prompts[0][:25], SamplingParams(max_new_tokens=20, ignore_eos=True))

    out = _run(sched, prompts, params, late_arrival)
    assert len(out["late"][0]) == 20 and all(len(out[f"r{i}"][0]) == 40 for i in range(3))
    recorded = [h[4] for h in policy.history if h[0] == "step"]
    # a call of 4 steps takes 0.1-0.2 s on a 2-core CPU (more under load); one with the admission in it over 0.6 s
    assert recorded and max(recorded) < 0.45, recorded
    assert sched.timings.admit_s > 0.6
    assert _free(engine, draft)


def test_a_pipelined_call_of_the_last_requests_is_recorded_at_its_own_size(dev_prompts, tiny_tokenizer):
    """At a run's end the pipeline's next call names only the requests the call before it leaves running: seen on
    the H200, 9 of 128, each of its request-steps ~10x a full batch's. Recorded at the batch the choice was made
    for (128), it pulled plain decoding's rate there under the whole chain's; it is recorded at its own size."""
    engine, draft = tiny_target(), tiny_draft()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 6)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (9, 9, 9, 9, 33, 41)]
    policy = Plain(budgets=(0, FULL), history=[])
    sched = Scheduler(OrderedTarget(engine), draft, engine.max_context, 8, feature_layers_for(draft), policy=policy,
                      plain_steps=8, overlap=TwoBatchOverlap(0))
    out = _run(sched, prompts, params)
    assert [len(out[f"r{i}"][0]) for i in range(6)] == [9, 9, 9, 9, 33, 41]
    steps = [h for h in policy.history if h[0] in ("step", "warm-up")]
    assert any(h[1] <= 2 for h in steps)  # calls of the last two requests, then the last one
    assert all(policy.bucket(h[7]) == policy.bucket(h[1]) for h in steps), steps
    assert _free(engine, draft)


class GoneTarget(OrderedTarget):
    """A remote target that goes away (every call from the `gone_at`-th on fails NotReady, as when it is killed:
    the calls in flight on its broken connection fail together) and comes back restarted (`restart`: it holds
    nothing). Records what the scheduler hands `release_later` (the ids the draft releases once it is back)."""

    def __init__(self, engine, gone_at: int):
        super().__init__(engine, delay_s=0.01)
        self.gone_at, self.gone = gone_at, False
        self.released_later: list[str] = []

    def _run(self, inputs, plain_steps, feature_rows):
        with self._lock:
            if len(self.calls) >= self.gone_at:
                self.gone = True
            gone = self.gone
        if gone:
            time.sleep(self.delay_s)
            with self._lock:
                self.pending -= 1
            raise NotReady("target: the target closed the verify lane's connection (end of stream)")
        return super()._run(inputs, plain_steps, feature_rows)

    def release_later(self, request_ids):
        self.released_later += list(request_ids)

    def restart(self) -> None:
        with self._lock:
            for rid in list(self.engine.requests):
                self.engine.release(rid)
            self.gone, self.gone_at = False, 1 << 30


def test_a_request_under_the_id_of_one_a_dead_target_failed_is_not_failed_by_that_ones_stale_call(
        dev_prompts, tiny_tokenizer):
    """QA: the target killed under a pipelined plain stretch failed the stream at the first call's landing, but the
    second call, sent before that landing, stayed in flight with no request left to land it. Once the target was
    back, a client's retry under the same request id was failed by that stale call (UNAVAILABLE with the old
    error, its id then released on the new target), and through the gateway a healthy, just restarted target was
    marked down again."""
    engine = tiny_target()
    prompts = _prompts(dev_prompts, tiny_tokenizer, 1)
    params = [SamplingParams(max_new_tokens=40, ignore_eos=True)]
    ref = _run(Scheduler(engine, None, engine.max_context, 8), prompts, params)
    target = GoneTarget(engine, gone_at=3)
    sched = Scheduler(target, None, engine.max_context, 8, plain_steps=4, overlap=TwoBatchOverlap(0))
    sched.add("r0", prompts[0], params[0])
    first = []
    while sched.has_work:
        first += sched.step()
    assert [e.finish_reason for e in first if e.error is not None] == [ABORT]  # the stream failed, the target gone
    target.restart()
    released = len(target.released_later)
    out = _run(sched, prompts, params)  # the client's retry, same id
    assert out == ref
    assert target.released_later[released:] == []  # the new request's id is not released on the new target
    assert _free(engine)
