"""The target service's feature staging (`SPECDEC_HOST_FEATURES=1`, `specdec.engine.host_features`) on a GPU with
captured graphs: every row's features copied to pinned host memory on a side stream beside the logits. A batch of
two requests, one verifying chains that accept most of their drafts (one slice of rows) and one a tree that accepts
its second branch (rows with a gap), with EAGLE-1 and EAGLE-3 features: tokens equal and features bit-equal to the
device path's, run as the same batches on twin requests; a verify waits for the GPU at most twice. The drafts are
the target's own greedy continuation, from a throwaway request prefilled with the twins' tokens so far (the first
version took them from plain steps run once ahead and required every verify to follow them: a bf16 near tie that a
tree's forward rounds apart from a plain step's failed it on an H100, session 45)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("layers", [(), (1, 2)])
def test_staged_features_equal_the_device_path_on_gpu(layers, monkeypatch):
    from repo_paths import TINY

    from specdec.engine.factory import EngineOptions, build_target
    from specdec.engine.host_features import StagedRows
    from specdec.engine.requests import PrefillInput, VerifyInput
    from specdec.host_copy import synchronizing_calls
    from specdec.sampling_params import SamplingParams

    monkeypatch.setenv("SPECDEC_HOST_FEATURES", "1")
    target = build_target(str(TINY / "target"), EngineOptions(device="cuda", dtype="bfloat16",
                                                              attention_backend="flashinfer", num_pages=512,
                                                              max_batch_size=8))
    assert target.graphs is not None
    reads = []
    real = StagedRows.host
    monkeypatch.setattr(StagedRows, "host", lambda self: reads.append(1) or real(self))
    params = SamplingParams(max_new_tokens=400, ignore_eos=True)
    prompts = [list(range(300, 360)), list(range(500, 541))]
    ids = {"dev": ("d0", "d1"), "host": ("h0", "h1")}
    for pair in ids.values():
        target.prefill([PrefillInput(rid, p, params, layers) for rid, p in zip(pair, prompts, strict=True)])
    gen = [[target.requests[rid].root] for rid in ids["dev"]]  # each twin pair's tokens so far
    assert gen == [[target.requests[rid].root] for rid in ids["host"]]

    def ahead(seq: list[int]) -> list[int]:
        """The target's greedy continuation of `seq` (plain steps of a throwaway request): drafts it accepts."""
        target.prefill([PrefillInput("ahead", seq, params, return_features=False)])
        first = target.requests["ahead"].root  # the token after `seq`
        out = target.verify([VerifyInput("ahead", [], [])], plain_steps=16)[0].tokens
        target.release("ahead")
        return [first, *out]

    def both(trees):
        """The same verify of the twins: the device path's outputs and the staged path's, compared."""
        dev = target.verify([VerifyInput(rid, *t) for rid, t in zip(ids["dev"], trees, strict=True)])
        host = target.verify([VerifyInput(rid, *t) for rid, t in zip(ids["host"], trees, strict=True)],
                             features_on_host=True)
        for d, h in zip(dev, host, strict=True):
            assert (d.tokens, d.num_accepted_drafts) == (h.tokens, h.num_accepted_drafts)
            assert d.features.device.type == "cuda" and h.features.device.type == "cpu"
            assert torch.equal(d.features.cpu(), h.features)
        return host

    futures, accepted = [[], []], 0
    for _ in range(6):
        for i in range(2):
            if len(futures[i]) < 4:  # a prefill and plain steps may round a near tie apart from a tree's forward
                futures[i] = ahead(prompts[i] + gen[i])
        a, b = futures[0][:3], futures[1][:2]
        trees = [([*a, 7], [-1, 0, 1, 2]), ([7, b[0], 7, b[1], 7], [-1, -1, 0, 1, 2])]
        for i, out in enumerate(both(trees)):
            accepted += out.num_accepted_drafts
            gen[i] += out.tokens
            same = out.tokens == futures[i][: len(out.tokens)]
            futures[i] = futures[i][len(out.tokens) :] if same else []
    assert reads and accepted >= 20, accepted  # staged, and most drafts accepted (at most 6 x (3 + 2))
    if len(futures[0]) < 3:
        futures[0] = ahead(prompts[0] + gen[0])
    chain = ([*futures[0][:3], 7], [-1, 0, 1, 2])
    syncs = synchronizing_calls(lambda: target.verify([VerifyInput("h0", *chain)], features_on_host=True))
    assert sum(syncs.values()) <= 2, syncs
    for pair in ids.values():
        for rid in pair:
            target.release(rid)
