"""Which extends the draft's captured extend takes (the graphs themselves need a GPU: tests/gpu checks replay ==
eager); this checks the fit on CPU: up to num_draft_tokens + 1 tokens a request, within the batch ladder, and room
in the request's KV reservation for the padding rows."""

from __future__ import annotations

import torch
from core_engines import tiny_draft

from specdec.engine.draft_extend_graphs import DraftExtendGraphs


def test_which_extends_fit_the_captured_shapes():
    draft = tiny_draft()
    graphs = DraftExtendGraphs(draft, max_batch_size=4, workspace=torch.empty(0))
    t = graphs.tokens
    assert t == draft.spec.num_draft_tokens + 1 and graphs.ladder == (1, 2, 4)
    feat = torch.zeros(1, draft.model.feature_size)
    try:
        for rid, budget in (("a", 200), ("b", 200), ("end", 40)):
            draft.add(rid, budget)
        draft.extend([("a", list(range(30)), feat.expand(30, -1)), ("end", list(range(30)), feat.expand(30, -1))])
        assert graphs.usable([("a", [1] * t, None)]) and graphs.usable([("a", [1], None), ("b", [2, 3], None)])
        assert not graphs.usable([("a", [1] * (t + 1), None)])  # a catch-up longer than the padded shape
        assert not graphs.usable([("a", [], None)])
        assert not graphs.usable([(r, [1], None) for r in ("a", "b", "end", "a", "b")])  # past the ladder
        pages = draft.kv.table("end").reserved_pages
        draft.requests["end"].kv_len = pages * draft.kv.page_size - t + 1  # the padding would pass its reservation
        assert not graphs.usable([("end", [1], None)])
        graphs.failed = True  # a capture failed: everything runs eagerly
        assert not graphs.usable([("a", [1], None)])
    finally:
        for rid in ("a", "b", "end"):
            draft.release(rid)
