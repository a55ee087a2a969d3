"""`TargetEngine.verify(..., features_on_host=True)` (the target service's verifies, `engine.host_features`): every
row of the forward is staged for the host and the committed rows read there. Tokens and features equal the
device path's, for chains and trees, batches, the hidden state (EAGLE-1) and layer inputs (EAGLE-3), requests
cut at their length limit, and batches the staging does not take (mixed feature layers, some without features).
On a CPU the staged rows are the forward's own; `tests/gpu` runs the side-stream copy."""

from __future__ import annotations

import pytest
import torch
from core_engines import restored_target

from specdec.engine.host_features import FeatureStager
from specdec.engine.requests import PrefillInput, VerifyInput
from specdec.sampling_params import SamplingParams


@pytest.fixture
def target():
    yield from restored_target()


CHAIN = ([11, 12, 13, 14], [-1, 0, 1, 2])
TREE = ([11, 12, 13, 14, 15], [-1, -1, 0, 1, 2])


def _run(target, on_host: bool, layers: list[tuple[int, ...]], trees, max_new: list[int], features=None):
    """Prefill one request per entry of `layers`, then three verifies of `trees` (one per request):
    [(tokens, features or None)] of every call."""
    features = features or [True] * len(layers)
    rids = [f"hf-{i}" for i in range(len(layers))]
    target.prefill([PrefillInput(rid, list(range(40 + 9 * i, 90 + 5 * i)),
                                 SamplingParams(max_new_tokens=m, ignore_eos=True), lay, return_features=f)
                    for i, (rid, lay, m, f) in enumerate(zip(rids, layers, max_new, features, strict=True))])
    got = []
    try:
        for _ in range(3):
            live = [(rid, tree) for rid, tree in zip(rids, trees, strict=True) if rid in target.requests]
            if not live:
                break
            outs = target.verify([VerifyInput(rid, *tree) for rid, tree in live], features_on_host=on_host)
            got += [(o.tokens, None if o.features is None else o.features.clone()) for o in outs]
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


@pytest.mark.parametrize("trees", [[CHAIN], [TREE], [CHAIN, CHAIN, CHAIN], [TREE, CHAIN]])
@pytest.mark.parametrize("layer_set", [(), (1, 2)])
def test_features_on_host_equal_the_device_path(target, trees, layer_set):
    layers = [layer_set] * len(trees)
    max_new = [7] + [40] * (len(trees) - 1)  # the first is cut at its length limit in the second call
    device = _run(target, False, layers, trees, max_new)
    host = _run(target, True, layers, trees, max_new)
    _same(device, host)
    assert any(f is not None and f.shape[0] < 5 for _, f in host)  # some call cut a path short


def test_batches_the_staging_does_not_take_still_get_their_features(target):
    trees = [CHAIN, TREE, CHAIN]
    mixed = [(), (1, 2), ()]
    _same(_run(target, False, mixed, trees, [40] * 3), _run(target, True, mixed, trees, [40] * 3))
    some = [(), (), ()]
    want = [True, False, True]
    got = _run(target, True, some, trees, [40] * 3, want)
    _same(_run(target, False, some, trees, [40] * 3, want), got)
    assert [f is None for _, f in got[:3]] == [False, True, False]


def test_staged_rows_on_a_cpu_are_the_forwards_own():
    hidden = torch.randn(6, 4)
    assert FeatureStager(torch.device("cpu")).stage([hidden]).host() is hidden
    aux = [torch.randn(6, 4), torch.randn(6, 4)]
    assert torch.equal(FeatureStager(torch.device("cpu")).stage(aux).host(), torch.cat(aux, dim=-1))


def test_a_forward_of_too_many_feature_bytes_is_gathered_after_the_verdict(target, monkeypatch):
    from specdec.engine import target_engine

    staged = []
    real = FeatureStager.stage
    monkeypatch.setattr(FeatureStager, "stage", lambda self, parts: staged.append(1) or real(self, parts))
    _run(target, True, [()], [CHAIN], [40])
    assert len(staged) == 3
    monkeypatch.setattr(target_engine, "STAGE_MAX_BYTES", 64)
    trees = [CHAIN, TREE]
    layers = [(), ()]
    _same(_run(target, False, layers, trees, [40, 40]), _run(target, True, layers, trees, [40, 40]))
    assert len(staged) == 3


def test_staging_that_fails_or_is_switched_off_leaves_the_device_path(target, monkeypatch, caplog):
    from specdec.engine import host_features

    device = _run(target, False, [()], [CHAIN], [40])
    monkeypatch.setenv("SPECDEC_HOST_FEATURES", "0")
    assert FeatureStager(torch.device("cpu")).stage([torch.zeros(2, 2)]) is None
    monkeypatch.delenv("SPECDEC_HOST_FEATURES")

    def refuse(*args):
        raise RuntimeError("no pinned memory here")

    target._stager = None
    monkeypatch.setattr(host_features, "StagedRows", refuse)
    with caplog.at_level("WARNING", logger="specdec.engine.host_features"):
        _same(device, _run(target, True, [()], [CHAIN], [40]))
    assert [r.message for r in caplog.records].count(
        "features are gathered on the device from now on: staging them for the host failed (no pinned memory "
        "here)") == 1
    target._stager = None
