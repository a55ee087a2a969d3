"""`TargetEngine.verify(..., features_on_host=True)` with staging on (`engine.host_features`): every row of the
forward is staged for the host and the committed rows read there. Tokens and features equal the device path's,
with drafts taken from the target's own greedy continuation so that chains accept several tokens, a tree accepts
its second branch (rows with a gap: an index read), a request is cut at its length limit, batches mix all three,
features are the hidden state (EAGLE-1) or layer inputs (EAGLE-3); batches the staging does not take, a staging
that fails, and staging off (the default) take the device path. On a CPU the staged rows are the forward's own;
`tests/gpu/test_host_features_gpu.py` runs the side-stream copy."""

from __future__ import annotations

import pytest
import torch
from core_engines import restored_target

from specdec.engine import host_features
from specdec.engine.host_features import FeatureStager, StagedRows
from specdec.engine.requests import PrefillInput, VerifyInput
from specdec.sampling_params import SamplingParams

WRONG = 3  # a token the tiny target's greedy continuation of these prompts never has at that place (asserted)


@pytest.fixture
def target(monkeypatch):
    monkeypatch.setenv("SPECDEC_HOST_FEATURES", "1")
    for engine in restored_target():
        engine._stager = None
        yield engine
        engine._stager = None


@pytest.fixture
def reads(monkeypatch):
    """How many staged reads the engine made."""
    count = []
    real = StagedRows.host
    monkeypatch.setattr(StagedRows, "host", lambda self: count.append(1) or real(self))
    return count


def _prompt(i: int) -> list[int]:
    return list(range(40 + 9 * i, 90 + 5 * i))


def _continuation(target, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation of `prompt`: its first token, then n more."""
    params = SamplingParams(max_new_tokens=n + 8, ignore_eos=True)
    first = target.prefill([PrefillInput("hf-cont", prompt, params, return_features=False)])[0].first_token
    try:
        return [first, *target.verify([VerifyInput("hf-cont", [], [])], plain_steps=n)[0].tokens]
    finally:
        target.release("hf-cont")


def _tree(kind: str, cont: list[int], done: int):
    """Drafts after the request's `done` tokens (its root is cont[done - 1]): `chain` accepts 3 of 4, `tree` its
    second branch (two tokens, rows 2 and 4), `miss` nothing."""
    nxt = cont[done : done + 4]
    assert WRONG not in nxt[:2]
    if kind == "chain":
        return [nxt[0], nxt[1], nxt[2], WRONG], [-1, 0, 1, 2]
    if kind == "tree":
        return [WRONG, nxt[0], WRONG, nxt[1], WRONG], [-1, -1, 0, 1, 2]
    return [WRONG, WRONG], [-1, 0]


def _run(target, on_host: bool, kinds: list[str], layers: list[tuple[int, ...]], max_new: list[int],
         features: list[bool] | None = None):
    """One request per entry of `kinds`, then four verifies (each request its kind of tree); [(tokens, features
    or None)] of every result."""
    features = features or [True] * len(kinds)
    conts = [_continuation(target, _prompt(i), 40) for i in range(len(kinds))]
    rids = [f"hf-{i}" for i in range(len(kinds))]
    target.prefill([PrefillInput(rid, _prompt(i), SamplingParams(max_new_tokens=m, ignore_eos=True), lay,
                                 return_features=f)
                    for i, (rid, lay, m, f) in enumerate(zip(rids, layers, max_new, features, strict=True))])
    done = dict.fromkeys(rids, 1)
    got = []
    try:
        for _ in range(4):
            live = [i for i, rid in enumerate(rids) if rid in target.requests]
            if not live:
                break
            outs = target.verify([VerifyInput(rids[i], *_tree(kinds[i], conts[i], done[rids[i]])) for i in live],
                                 features_on_host=on_host)
            for o, i in zip(outs, live, strict=True):
                assert o.tokens == conts[i][done[o.request_id] : done[o.request_id] + len(o.tokens)]
                done[o.request_id] += len(o.tokens)
                got.append((o.tokens, None if o.features is None else o.features.clone()))
    finally:
        for rid in rids:
            if rid in target.requests:
                target.release(rid)
    return got


def _same(a, b):
    assert len(a) == len(b)
    for (ta, fa), (tb, fb) in zip(a, b, strict=True):
        assert ta == tb
        assert (fa is None) == (fb is None)
        if fa is not None:
            assert fa.shape == fb.shape and torch.equal(fa, fb)


@pytest.mark.parametrize("kinds", [["chain"], ["tree"], ["chain", "tree", "miss"], ["tree", "chain"]])
@pytest.mark.parametrize("layer_set", [(), (1, 2)])
def test_features_on_host_equal_the_device_path(target, reads, kinds, layer_set):
    layers = [layer_set] * len(kinds)
    max_new = [6] + [40] * (len(kinds) - 1)  # the first request is cut at 6 tokens in its second call
    device = _run(target, False, kinds, layers, max_new)
    assert not reads
    host = _run(target, True, kinds, layers, max_new)
    assert reads  # the staged path ran
    _same(device, host)
    sizes = [len(t) for t, _ in host]
    assert 4 in sizes or 3 in sizes  # several accepted: a chain's 3 + its bonus, a tree's 2 + bonus
    assert sum(sizes[:: len(kinds)][:2]) == 5  # the first request: 1 prefill token + 5 more, cut short in call 2


def test_batches_the_staging_does_not_take_still_get_their_features(target, reads):
    kinds = ["chain", "tree", "chain"]
    mixed = [(), (1, 2), ()]
    _same(_run(target, False, kinds, mixed, [40] * 3), _run(target, True, kinds, mixed, [40] * 3))
    some = [(), (), ()]
    want = [True, False, True]
    got = _run(target, True, kinds, some, [40] * 3, want)
    assert not reads  # neither batch is staged
    _same(_run(target, False, kinds, some, [40] * 3, want), got)
    assert [f is None for _, f in got[:3]] == [False, True, False]


def test_a_forward_of_too_many_feature_bytes_is_gathered_after_the_verdict(target, reads, monkeypatch):
    _run(target, True, ["chain"], [()], [40])
    assert len(reads) == 4
    monkeypatch.setattr(host_features, "STAGE_MAX_BYTES", 64)
    kinds, layers = ["chain", "tree"], [(), ()]
    _same(_run(target, False, kinds, layers, [40, 40]), _run(target, True, kinds, layers, [40, 40]))
    assert len(reads) == 4


def test_staging_is_off_by_default_and_a_failing_one_leaves_the_device_path(target, reads, monkeypatch, caplog):
    device = _run(target, False, ["chain"], [()], [40])
    monkeypatch.delenv("SPECDEC_HOST_FEATURES")
    _same(device, _run(target, True, ["chain"], [()], [40]))
    assert not reads
    monkeypatch.setenv("SPECDEC_HOST_FEATURES", "1")
    target._stager = None

    def refuse(*args):
        raise RuntimeError("no pinned memory here")

    monkeypatch.setattr(host_features, "StagedRows", refuse)
    with caplog.at_level("WARNING", logger="specdec.engine.host_features"):
        _same(device, _run(target, True, ["chain"], [()], [40]))
    assert [r.message for r in caplog.records].count(
        "features are gathered on the device from now on: staging them for the host failed (no pinned memory "
        "here)") == 1


def test_staged_rows_on_a_cpu_are_the_forwards_own():
    hidden = torch.randn(6, 4)
    assert FeatureStager(torch.device("cpu"), on=True).stage([hidden]).host() is hidden
    aux = [torch.randn(6, 4), torch.randn(6, 4)]
    assert torch.equal(FeatureStager(torch.device("cpu"), on=True).stage(aux).host(), torch.cat(aux, dim=-1))
    assert FeatureStager(torch.device("cpu"), on=False).stage([hidden]) is None
