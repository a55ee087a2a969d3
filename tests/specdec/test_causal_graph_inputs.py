"""What the target hands a captured causal forward (`TargetGraphs.run_causal`: token ids, positions, each
request's page list and context length) describes the same forward as the eager path's slot tensors. CUDA graphs
need a GPU, so a stand-in runs the eager forward from exactly those inputs; `tests/gpu` checks real replay == eager.
"""

from __future__ import annotations

import torch
from core_engines import tiny_target

from specdec.attention import AttentionBatch, SeqAttention
from specdec.engine.requests import PrefillInput, VerifyInput
from specdec.sampling_params import SamplingParams


class EagerFromPages:
    """Stands in for TargetGraphs: claims every shape and runs the eager forward from run_causal's inputs only."""

    def __init__(self, target):
        self.target, self.calls = target, []

    def usable(self, *args) -> bool:
        return True

    def run_causal(self, ids, positions, page_lists, lens, n, aux_layers, inputs_taken=None):
        t, ps = self.target, self.target.kv.page_size
        self.calls.append((len(lens), n))
        seqs = [SeqAttention(torch.tensor([pages[p // ps] * ps + p % ps for p in range(end)]), n)
                for pages, end in zip(page_lists, lens, strict=True)]
        write = torch.cat([s.ctx_slots[-n:] for s in seqs])
        batch = t.backend.plan(AttentionBatch(seqs, write))
        out = t.model(torch.as_tensor(ids), torch.as_tensor(positions), t.backend, batch, aux_layers)
        return out.hidden, out.aux

    def run(self, *args, **kwargs):
        raise AssertionError("a causal batch took the slot path")


def _run(target, graphs, feature_layers=()):
    """Chains of 3 for three requests of different lengths, then 5 plain steps: tokens and features."""
    target.graphs = graphs
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    rids = [f"cg-{i}" for i in range(3)]
    try:
        target.prefill([PrefillInput(rid, list(range(200 + 7 * i, 230 + 13 * i)), params,
                                     feature_layers=feature_layers) for i, rid in enumerate(rids)])
        outs = []
        for _ in range(3):
            outs += target.verify([VerifyInput(rid, [5, 6, 7], [-1, 0, 1]) for rid in rids])
        outs += target.verify([VerifyInput(rid, [], []) for rid in rids], plain_steps=5)
        return [(o.tokens, o.features) for o in outs]
    finally:
        target.graphs = None
        for rid in rids:
            if rid in target.requests:
                target.release(rid)


def test_chains_and_plain_steps_from_page_lists_match_the_slot_path():
    target = tiny_target()
    for layers in ((), (1, 2)):  # EAGLE-1 (the final hidden state) and EAGLE-3-style aux layers
        stand_in = EagerFromPages(target)
        got, want = _run(target, stand_in, layers), _run(target, None, layers)
        assert stand_in.calls[:3] == [(3, 4)] * 3 and stand_in.calls[3:] == [(3, 1)] * 5
        for (tokens, feats), (tokens_ref, feats_ref) in zip(got, want, strict=True):
            assert tokens == tokens_ref
            torch.testing.assert_close(feats, feats_ref)
