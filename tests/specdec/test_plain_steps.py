"""Several plain decode steps in one verify call (`plain_steps`): the same tokens and features as single steps,
a request that finishes stops there, and bad calls are refused before anything is committed."""

from __future__ import annotations

import pytest
import torch
from core_engines import tiny_target

from specdec.engine.plain_steps import MAX_PLAIN_STEPS
from specdec.engine.requests import RUNNING, PrefillInput, VerifyInput
from specdec.errors import InvalidInput
from specdec.sampling_params import SamplingParams


def _admit(target, budgets: dict[str, int], layers: tuple[int, ...] = ()) -> None:
    target.prefill([PrefillInput(rid, list(range(300 + 7 * i, 340 + 7 * i)),
                                 SamplingParams(max_new_tokens=n, ignore_eos=True), layers)
                    for i, (rid, n) in enumerate(budgets.items())])


class Recording:
    """A target engine that records its calls: (batch, plain steps) of each verify, the request ids of each
    prefill."""

    def __init__(self, engine):
        self.engine, self.calls, self.prefills = engine, [], []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def verify(self, inputs, plain_steps=1, feature_rows=0):
        self.calls.append((len(inputs), plain_steps))
        return self.engine.verify(inputs, plain_steps=plain_steps, feature_rows=feature_rows)

    def prefill(self, inputs):
        self.prefills.append([i.request_id for i in inputs])
        return self.engine.prefill(inputs)


def test_plain_steps_equal_single_steps_and_stop_where_a_request_finishes():
    target = tiny_target()
    budgets = {"long": 12, "short": 3}  # "short" finishes inside the first call of 4 steps
    single = {rid: ([], []) for rid in budgets}
    try:
        _admit(target, budgets)
        while target.requests.keys() & budgets.keys():
            for out in target.verify([VerifyInput(r, [], []) for r in budgets if r in target.requests]):
                single[out.request_id][0].extend(out.tokens)
                single[out.request_id][1].append(out.features)
        _admit(target, budgets)
        calls = []
        while target.requests.keys() & budgets.keys():
            calls.append(target.verify([VerifyInput(r, [], []) for r in budgets if r in target.requests],
                                       plain_steps=4))
    finally:
        for rid in budgets:
            if rid in target.requests:
                target.release(rid)
    assert len(calls) == 3 and [len(c) for c in calls] == [2, 1, 1]
    first = {o.request_id: o for o in calls[0]}
    assert first["short"].tokens == single["short"][0] and first["short"].finish_reason != RUNNING
    assert first["long"].num_accepted_drafts == 0 and first["long"].finish_reason == RUNNING
    long_tokens = [t for c in calls for o in c if o.request_id == "long" for t in o.tokens]
    assert long_tokens == single["long"][0]
    assert first["long"].features.shape[0] == 4
    assert torch.allclose(first["long"].features, torch.cat(single["long"][1][:4]), atol=1e-5)


def test_a_request_reaching_max_new_tokens_inside_a_call_does_not_split_it():
    """A request whose max_new_tokens ends it inside a plain call runs the call's steps with the others (one chunk,
    one host sync) and keeps only its tokens up to the limit; its pages go back. Steps that no request wants are
    not run, and the context still bounds a chunk: a request with less room than the call splits it."""
    target = tiny_target()
    chunks = []
    run = target._plain_chunk
    target._plain_chunk = lambda live, k, *rest: chunks.append((len(live), k)) or run(live, k, *rest)
    free = target.kv.num_free_pages
    _admit(target, {"long": 12, "short": 2})
    outs = {o.request_id: o for o in target.verify([VerifyInput(r, [], []) for r in ("long", "short")],
                                                   plain_steps=4)}
    assert chunks == [(2, 4)]
    assert len(outs["short"].tokens) == 1 and outs["short"].finish_reason == "length"  # the prefill made one
    assert outs["short"].features.shape[0] == 1 and "short" not in target.requests
    assert len(outs["long"].tokens) == 4 and outs["long"].finish_reason == RUNNING
    target.release("long")
    assert target.kv.num_free_pages == free
    chunks.clear()  # no live request wants the call's last steps: they are not run
    _admit(target, {"a": 3, "b": 2})
    outs = target.verify([VerifyInput(r, [], []) for r in ("a", "b")], plain_steps=8)
    assert chunks == [(2, 2)] and [len(o.tokens) for o in outs] == [2, 1] and not target.requests
    chunks.clear()
    near = target.max_context - 3  # two tokens of room: the prefill's token, then 2 more
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    target.prefill([PrefillInput("edge", list(range(300, 300 + near)), params),
                    PrefillInput("free", list(range(300, 340)), params)])
    outs = {o.request_id: o for o in target.verify([VerifyInput(r, [], []) for r in ("edge", "free")],
                                                   plain_steps=4)}
    assert chunks == [(2, 2), (1, 2)] and len(outs["edge"].tokens) == 2 and len(outs["free"].tokens) == 4
    target.release("free")


@pytest.mark.parametrize("layers", [(), (1, 2)])  # the final hidden state (EAGLE-1), two layers' inputs (EAGLE-3)
def test_a_plain_call_asking_for_its_last_feature_rows_gets_those_of_the_whole_call(layers):
    """`feature_rows` = 2 on a 5-step call: a request that runs on gets its last 2 steps' features, the same
    values as the call with every row; one that ends inside the call (at its second token) gets none (a finished
    result carries no rows), so only the last 2 steps copy features."""
    target = tiny_target()
    got = []
    for rows in (0, 2):
        _admit(target, {"long": 12, "short": 3}, layers)
        got.append({o.request_id: o for o in target.verify([VerifyInput(r, [], []) for r in ("long", "short")],
                                                          plain_steps=5, feature_rows=rows)})
        target.release("long")
    full, last = got
    assert full["long"].tokens == last["long"].tokens and full["short"].tokens == last["short"].tokens
    assert full["long"].features.shape[0] == 5 and last["long"].features.shape[0] == 2
    assert torch.equal(last["long"].features, full["long"].features[-2:])
    assert len(full["short"].tokens) == 2 and full["short"].features.shape[0] == 2 and last["short"].features is None


def test_a_plain_call_asking_for_its_last_rows_runs_its_earlier_steps_without_feature_work(monkeypatch):
    """EAGLE-3 features (two layers' inputs), `feature_rows` 2 on a 5-step call: the first 3 steps return no aux
    layers and build no features (before, each built every request's features and threw them away: the tiny pair's
    16-step plain calls took 7.6-8.2 ms on an H200 against 6.1-6.4 without features); the last 2 return them. The
    tokens and rows are the same as with every row (test above)."""
    target = tiny_target()
    layers, aux_asked, built = [], [], []
    forward, batch_features = target._forward_causal, target._batch_features

    def recording_forward(*args, aux=True, **kwargs):
        aux_asked.append(aux)
        out = forward(*args, aux=aux, **kwargs)
        layers.append(tuple(out[1]))
        return out

    monkeypatch.setattr(target, "_forward_causal", recording_forward)
    monkeypatch.setattr(target, "_batch_features", lambda *a, **k: built.append(1) or batch_features(*a, **k))
    _admit(target, {"a": 12, "b": 12}, (1, 2))
    outs = target.verify([VerifyInput(r, [], []) for r in ("a", "b")], plain_steps=5, feature_rows=2)
    assert aux_asked == [False] * 3 + [True] * 2 and layers == [()] * 3 + [(1, 2)] * 2 and not built
    assert all(o.features.shape[0] == 2 and len(o.tokens) == 5 for o in outs)
    for rid in ("a", "b"):
        target.release(rid)


@pytest.mark.parametrize("steps,tokens,match", [(0, [], "outside"), (MAX_PLAIN_STEPS + 1, [], "outside"),
                                                 (2, [5], "empty trees")])
def test_bad_plain_steps_are_refused_before_anything_is_committed(steps, tokens, match):
    target = tiny_target()
    try:
        _admit(target, {"r": 10})
        before = target.requests["r"].num_generated
        with pytest.raises(InvalidInput, match=match):
            target.verify([VerifyInput("r", tokens, [-1] * len(tokens))], plain_steps=steps)
        assert target.requests["r"].num_generated == before
    finally:
        target.release("r")


def test_a_stop_token_inside_a_chunk_ends_the_request_there_and_frees_its_pages():
    """Greedy plain steps run as one chunk with one host sync; a stop token met inside it keeps the tokens up to
    it, and the pages of the steps computed past it go back with the request."""
    target = tiny_target()
    free = target.kv.num_free_pages
    prompt = list(range(300, 340))
    target.prefill([PrefillInput("ref", prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))])
    ref = target.verify([VerifyInput("ref", [], [])], plain_steps=7)[0].tokens
    stop = next(t for t in ref[2:] if t not in ref[:2])  # first reached in the chunk's third step or later
    cut = ref.index(stop) + 1
    target.prefill([PrefillInput("s", prompt, SamplingParams(max_new_tokens=50, stop_token_ids=[stop]))])
    out = target.verify([VerifyInput("s", [], [])], plain_steps=8)[0]
    assert out.tokens == ref[:cut] and out.finish_reason == "stop" and out.features.shape[0] == cut
    assert "s" not in target.requests and target.kv.num_free_pages == free


def test_sampled_requests_take_one_step_at_a_time_with_the_same_draws():
    """A batch with a sampled (non-greedy) request draws on the host each step: seeded, the tokens of one call of
    4 steps equal those of 4 single steps."""
    target = tiny_target()
    params = {"g": SamplingParams(max_new_tokens=20, ignore_eos=True),
              "t": SamplingParams(max_new_tokens=20, ignore_eos=True, temperature=0.8, seed=7)}
    runs = []
    for steps in (1, 4):
        target.prefill([PrefillInput(rid, list(range(300, 330)), p) for rid, p in params.items()])
        tokens = {rid: [] for rid in params}
        for _ in range(4 // steps):
            more = {"plain_steps": steps} if steps > 1 else {}
            for out in target.verify([VerifyInput(rid, [], []) for rid in params], **more):
                tokens[out.request_id] += out.tokens
        runs.append(tokens)
        for rid in params:
            target.release(rid)
    assert runs[0] == runs[1] and all(len(t) == 4 for t in runs[0].values())


def test_requests_admitted_without_features_get_none_and_the_same_tokens():
    """Plain Generate admits its requests without features (no draft reads them): verify and plain-step chunks
    gather none for them, next to a request that wants them, and decode the same tokens."""
    target = tiny_target()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = list(range(300, 340))
    target.prefill([PrefillInput("with", prompt, params), PrefillInput("without", prompt, params, (), False)])
    outs = target.verify([VerifyInput(r, [], []) for r in ("with", "without")], plain_steps=4)
    outs += target.verify([VerifyInput(r, [5, 6], [-1, 0]) for r in ("with", "without")])
    by = {}
    for out in outs:
        by.setdefault(out.request_id, []).append(out)
    assert all(o.features is None for o in by["without"]) and all(o.features is not None for o in by["with"])
    assert [o.tokens for o in by["with"]] == [o.tokens for o in by["without"]]
    target.prefill([PrefillInput("alone", prompt, params, (), False)])
    assert target.verify([VerifyInput("alone", [], [])], plain_steps=3)[0].features is None
    for rid in ("with", "without", "alone"):
        target.release(rid)


@pytest.mark.parametrize("layers", [[(1, 2), (1, 2)], [(1, 2), ()]])  # one layer set (one copy per step); mixed
def test_chunk_features_of_aux_layers_equal_single_steps(layers):
    """EAGLE-3 drafts read the inputs of some target layers: a chunk's feature rows == those of single steps,
    when the batch shares its feature layers and when it mixes them (an EAGLE-1 and an EAGLE-3 draft)."""
    target = tiny_target()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    rids = [f"r{i}" for i in range(len(layers))]

    def admit():
        target.prefill([PrefillInput(rid, list(range(300 + 5 * i, 330 + 5 * i)), params, lay)
                        for i, (rid, lay) in enumerate(zip(rids, layers, strict=True))])

    admit()
    single = {rid: [] for rid in rids}
    for _ in range(4):
        for out in target.verify([VerifyInput(r, [], []) for r in rids]):
            single[out.request_id].append(out)
    for rid in rids:
        target.release(rid)
    admit()
    chunk = {o.request_id: o for o in target.verify([VerifyInput(r, [], []) for r in rids], plain_steps=4)}
    for rid, lay in zip(rids, layers, strict=True):
        ref = torch.cat([o.features for o in single[rid]])
        assert chunk[rid].tokens == [t for o in single[rid] for t in o.tokens]
        assert chunk[rid].features.shape == ref.shape == (4, target.cfg.hidden_size * max(1, len(lay)))
        assert torch.allclose(chunk[rid].features, ref, atol=1e-5)
        target.release(rid)


def test_plain_calls_ramp_up_after_each_admission_so_a_late_arrival_joins_soon():
    """A scheduler asking for 16 plain steps per call starts at PLAIN_STEPS after an admission and doubles while
    no one joins: a request arriving during the first call waits 4 steps to join, not 16. The tokens are those
    of one step per call."""
    from specdec.engine.plain_steps import PLAIN_STEPS
    from specdec.engine.scheduler import Scheduler

    def run(plain_steps):
        target = Recording(tiny_target())
        sched = Scheduler(target, None, target.max_context, 4, plain_steps=plain_steps)
        sched.admit_window_s = 0.0  # the ramp alone (no call length fits a window)
        out = {"a": [], "b": []}
        sched.add("a", list(range(300, 340)), SamplingParams(max_new_tokens=40, ignore_eos=True))
        for ev in sched.step():  # admits "a", then its first plain call
            out[ev.request_id] += ev.tokens
        sched.add("b", list(range(400, 430)), SamplingParams(max_new_tokens=30, ignore_eos=True))
        while sched.has_work:
            for ev in sched.step():
                out[ev.request_id] += ev.tokens
        assert target.kv.num_free_pages == target.kv.num_total_pages
        return out, target.calls

    single, _ = run(1)
    tokens, calls = run(16)
    assert tokens == single
    assert calls[:5] == [(1, PLAIN_STEPS), (2, PLAIN_STEPS), (2, 8), (2, 16), (2, 16)], calls


def test_ramp_calls_do_not_feed_the_policy():
    """Calls shortened by the ramp after an admission say how soon newcomers join, not how fast plain decoding is:
    the policy learns from whole-length plain calls only (and speculative steps), and not from the call in which
    the batch ends (`ENDING_SHARE`: here also cut short by the length limit)."""
    from core_engines import tiny_draft

    from specdec.engine.adaptive import FULL, SpeculationPolicy
    from specdec.engine.generate import feature_layers_for
    from specdec.engine.scheduler import Scheduler

    class Plain(SpeculationPolicy):
        def choose(self, batch_size):
            return 0

    target, draft = Recording(tiny_target()), tiny_draft()
    policy = Plain(budgets=(0, FULL), history=[])
    sched = Scheduler(target, draft, target.max_context, 4, feature_layers_for(draft), policy=policy, plain_steps=16)
    sched.admit_window_s = 0.0  # the ramp alone: 4, 8, then 16 steps a call
    for i in range(2):
        sched.add(f"r{i}", list(range(300 + i, 340 + i)), SamplingParams(max_new_tokens=60, ignore_eos=True))
    while sched.has_work:
        sched.step()
    assert [k for _, k in target.calls][:3] == [4, 8, 16]
    recorded = [h[5] for h in policy.history if h[0] == "step"]
    assert recorded and all(steps == 16 for steps in recorded)
    assert len(recorded) == sum(k > 1 for _, k in target.calls) - 3  # two ramp calls, the last call
    assert target.kv.num_free_pages == target.kv.num_total_pages


def test_the_ramp_starts_at_the_steps_that_fit_the_admission_window():
    """After an admission the first plain call holds what fits in `admit_window_s` at the latest call's seconds per
    step (at least PLAIN_STEPS, at most the scheduler's plain steps): a small model's fast steps skip the ramp."""
    from specdec.engine.plain_steps import PLAIN_STEPS
    from specdec.engine.scheduler import Scheduler

    sched = Scheduler(tiny_target(), None, 2048, 8, plain_steps=16)
    sched.running = {"a": None, "b": None}
    for step_s, first in ((None, PLAIN_STEPS), (0.01, PLAIN_STEPS), (0.0025, 10), (0.001, 16)):
        sched._plain_ramp, sched._plain_step_s = PLAIN_STEPS, step_s
        assert sched._plain_steps_per_call(micro=False) == first, step_s
        assert sched._plain_steps_per_call(micro=False) == min(16, 2 * first)


def test_an_idle_scheduler_gathers_a_burst_into_one_admission():
    """With `gather_s`, an idle scheduler admits once no request came for GATHER_GAP_S (or `gather_s` after the
    first): two requests a moment apart join in one prefill, where without it the first is admitted alone. A lone
    request waits only the gap."""
    import time

    from specdec.engine.admission import GATHER_GAP_S
    from specdec.engine.scheduler import Scheduler

    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    for gather_s, waves in ((0.0, [["a"], ["b"]]), (0.05, [["a", "b"]])):
        target = Recording(tiny_target())
        sched = Scheduler(target, None, target.max_context, 4, gather_s=gather_s)
        sched.add("a", list(range(300, 320)), params)
        sched.step()
        sched.add("b", list(range(400, 420)), params)
        while sched.has_work:
            sched.step()
        assert target.prefills == waves
        assert target.kv.num_free_pages == target.kv.num_total_pages
    # a window far longer than the admission's own work (a prefill and a plain step took up to ~50 ms under CI
    # load, and over 0.5 s once beside QA helpers' load), so waiting for the window cannot pass for waiting the gap
    sched = Scheduler(Recording(tiny_target()), None, 2048, 4, gather_s=5.0)
    sched.add("c", list(range(300, 320)), params)
    t0 = time.monotonic()
    while not sched.step():  # its first events come with its admission
        pass
    assert GATHER_GAP_S <= time.monotonic() - t0 < 2.5


def test_a_plain_call_naming_a_request_an_earlier_call_finished_gets_an_empty_result():
    """A draft keeps two plain calls in flight: the second names requests the first may finish. The target
    answers those with no tokens and the finish reason, runs the rest; trees for them, and ids it never finished
    (released by the caller, or unknown), are still refused; a new request under the same id runs normally."""
    from specdec.errors import UnknownRequest

    target = tiny_target()
    _admit(target, {"short": 3, "long": 20, "gone": 20})
    target.release("gone")
    first = target.verify([VerifyInput("short", [], []), VerifyInput("long", [], [])], plain_steps=4)
    assert first[0].finish_reason == "length" and len(first[0].tokens) == 2  # the prefill made the first
    second = target.verify([VerifyInput("short", [], []), VerifyInput("long", [], [])], plain_steps=4,
                           feature_rows=1)
    assert second[0].request_id == "short" and second[0].tokens == [] and second[0].finish_reason == "length"
    assert second[0].features is None
    assert len(second[1].tokens) == 4 and second[1].finish_reason == RUNNING and second[1].features.shape[0] == 1
    with pytest.raises(UnknownRequest, match="finished"):
        target.verify([VerifyInput("short", [5], [-1]), VerifyInput("long", [], [])])
    for rid in ("gone", "never"):
        with pytest.raises(UnknownRequest):
            target.verify([VerifyInput(rid, [], []), VerifyInput("long", [], [])], plain_steps=2)
    assert target.requests["long"].num_generated == 1 + 4 + 4  # the refused calls committed nothing
    _admit(target, {"short": 5})
    assert "short" not in target.finished
    assert len(target.verify([VerifyInput("short", [], [])], plain_steps=2)[0].tokens) == 2
    for rid in ("short", "long"):
        target.release(rid)
    assert target.kv.num_free_pages == target.kv.num_total_pages
