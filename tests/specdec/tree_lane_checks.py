"""The tree proposal through lanes (`DraftTreeGraphs`) against the eager proposal, on tiny random EAGLE-1 and
EAGLE-3 heads in float32: every candidate of every depth (all k + (S - 1) k^2 of them, so the lanes chosen at each
depth matter) with its parent, for requests whose cached lengths end anywhere in a page (one after a skip), in
two orders and sizes; the requests' own K/V untouched and no page leaked. Run as
`python tree_lane_checks.py cpu` under TRITON_INTERPRET=1 (tests/specdec/test_tree_lanes.py: the lanes run
eagerly), or `python tree_lane_checks.py cuda` (tests/gpu: the captured graphs, padded batches)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from core_checkpoints import make_eagle, make_llama_target  # noqa: E402

from specdec.engine.draft_engine import SpecConfig  # noqa: E402
from specdec.engine.draft_tree_graphs import DraftTreeGraphs  # noqa: E402
from specdec.engine.factory import EngineOptions, build_draft  # noqa: E402

LENGTHS = (5, 8, 11, 7, 1, 14)  # pages of 4: cached lengths ending at every offset, one on a page's end


def check(kind: str, device: str, spec: SpecConfig, root: Path) -> None:
    make_llama_target(root / "t", vocab=96, hidden=64, layers=2, heads=4, kv_heads=2, shard=False)
    cfg = json.loads((root / "t" / "config.json").read_text())
    head = make_eagle(root / kind, cfg, kind, draft_vocab=48 if kind == "eagle3" else None)
    if kind == "eagle3":  # layers a 2-layer target has (its default ones, 2, 1 and -1, are refused at load)
        head_cfg = json.loads((head / "config.json").read_text())
        head_cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}
        (head / "config.json").write_text(json.dumps(head_cfg))
    opts = EngineOptions(device=device, num_pages=400, page_size=4, max_batch_size=8, cuda_graphs=False)
    eager, laned = (build_draft(str(root / kind), str(root / "t"), spec, opts, 256) for _ in range(2))
    lanes = DraftTreeGraphs(laned, 8, None, capture=device != "cpu")
    assert lanes.ladder[-1] == 8, lanes.ladder
    g = torch.Generator().manual_seed(0)
    items = [(f"r{i}", [(7 * i + j) % 96 for j in range(n)], torch.randn(n, eager.model.feature_size, generator=g))
             for i, n in enumerate(LENGTHS)]
    for eng in (eager, laned):
        for rid, _, _ in items:
            eng.add(rid, 100)
        eng.extend(items)
        eng.skip("r1", 9)  # its next position is 9 past its cached length
    kv_before = (laned.kv.k.clone(), laned.kv.v.clone())
    lane_slots = set(lanes.pages.reshape(-1).tolist())
    rids = [r for r, _, _ in items]
    for order, size in ((rids, spec.num_draft_tokens), (rids[::-1][:3], 7)):
        want, got = eager.propose(order, size), lanes.propose(order, size)
        if device == "cpu":  # the same float32 arithmetic: the same trees, node for node
            assert want == got, (kind, order, size, want, got)
        else:  # cuBLAS / torch attention against the Triton kernel: siblings whose probabilities tie to ~1e-7 may
            # come in either order, and a near-tie at the cut may swap one node of one tree
            differ = [(a, b) for a, b in zip(want, got, strict=True) if paths(a) != paths(b)]
            assert len(differ) <= 1, (kind, order, size, differ)
    # only the lanes' own pages were written
    for before, after in zip(kv_before, (laned.kv.k, laned.kv.v), strict=True):
        pages = before.shape[1] // laned.kv.page_size
        changed = (before != after).view(before.shape[0], pages, -1).any(-1).any(0).nonzero().flatten().tolist()
        assert set(changed) <= lane_slots, (changed, sorted(lane_slots))
    for rid in rids:
        laned.release(rid)
    assert laned.kv.num_free_pages + len(lanes.pages.reshape(-1)) == laned.kv.num_total_pages


def paths(tree) -> list[tuple[int, ...]]:
    """A tree as the sorted token paths from the root to each node (the same tree in any node order)."""
    out = []
    for i in range(len(tree.tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        out.append(tuple(reversed(path)))
    return sorted(out)


def main(device: str) -> None:
    torch.set_default_dtype(torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("eagle1", "eagle3"):
            for spec in (SpecConfig(4, 3, 30), SpecConfig(3, 2, 10)):
                check(kind, device, spec, Path(tmp) / f"{kind}-{spec.num_steps}")
    print("all tree lane checks passed")


if __name__ == "__main__":
    main(sys.argv[1])
