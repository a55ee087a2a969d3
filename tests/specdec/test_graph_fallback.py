"""A CUDA-graph capture that fails: at start-up it stops the engine with a message naming --disable-cuda-graph;
later (a new tree size) the engine logs it and runs that shape eagerly, with the same results. The graphs are
stand-ins here (CUDA graphs need a GPU); tests/gpu covers real capture and replay."""

from __future__ import annotations

import pytest
import torch
from core_engines import tiny_draft, tiny_target

from specdec.attention.graph_backend import GraphCaptureError, capture_at_startup, capture_or_go_eager
from specdec.engine.requests import PrefillInput, VerifyInput
from specdec.errors import ConfigError
from specdec.sampling_params import SamplingParams


class FailingGraphs:
    """Claims every shape, then fails to capture it (as TargetGraphs / DraftChainGraphs do on a bad GPU)."""

    def __init__(self):
        self.calls = 0

    def usable(self, *args) -> bool:
        return True

    def run(self, *args):
        self.calls += 1
        raise GraphCaptureError("capture failed")

    propose = extend = run_causal = run

    def capture_startup(self):
        raise RuntimeError("CUDA error: out of memory")


def test_startup_capture_failure_names_the_flag():
    with pytest.raises(ConfigError, match="--disable-cuda-graph") as info:
        capture_at_startup(FailingGraphs(), "target")
    assert "out of memory" in str(info.value)


def test_a_later_capture_failure_forgets_the_shape_and_names_the_flag(caplog):
    forgotten = []

    def capture():
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(GraphCaptureError):
        capture_or_go_eager(capture, "the target's 9-token forwards", lambda: forgotten.append(True))
    assert forgotten == [True]
    assert "--disable-cuda-graph" in caplog.text and "9-token" in caplog.text


def test_target_verify_falls_back_to_eager_when_capture_fails():
    target = tiny_target()
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompt = list(range(300, 340))
    outs = {}
    for label, graphs in (("eager", None), ("fallback", FailingGraphs())):
        target.graphs = graphs
        rid = f"fb-{label}"
        try:
            target.prefill([PrefillInput(rid, prompt, params)])
            outs[label] = [target.verify([VerifyInput(rid, [5, 6, 7], [-1, 0, 1])])[0] for _ in range(3)]
            target.release(rid)
        finally:
            target.graphs = None
        if graphs is not None:
            assert graphs.calls == 3
    for a, b in zip(outs["eager"], outs["fallback"], strict=True):
        assert a.tokens == b.tokens and a.features.equal(b.features)


def test_draft_propose_falls_back_to_eager_when_capture_fails():
    draft = tiny_draft()
    draft.add("p", 200)
    feats = torch.randn(30, draft.model.feature_size, generator=torch.Generator().manual_seed(0))
    draft.extend([("p", list(range(100, 130)), feats)])
    eager = draft.propose(["p"])
    draft.graphs = FailingGraphs()
    try:
        assert draft.propose(["p"]) == eager
        assert draft.kv.length("p") == draft.requests["p"].kv_len  # no temporary slots left behind
    finally:
        draft.graphs = None
        draft.release("p")


def test_draft_extend_falls_back_to_eager_when_capture_fails():
    draft = tiny_draft()
    feats = torch.randn(34, draft.model.feature_size, generator=torch.Generator().manual_seed(0))
    states = []
    for graphs in (None, FailingGraphs()):
        draft.extend_graphs = graphs
        draft.add("p", 200)
        try:
            draft.extend([("p", list(range(100, 130)), feats[:30])])
            draft.extend([("p", [7, 8, 9, 10], feats[30:])])
            assert draft.requests["p"].kv_len == draft.kv.length("p") == 34
            states.append((draft.requests["p"].topk_index.tolist(), draft.requests["p"].hidden))
        finally:
            draft.extend_graphs = None
            draft.release("p")
    assert states[0][0] == states[1][0] and torch.equal(states[0][1], states[1][1])
