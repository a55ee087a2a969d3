"""The target service's feature staging (`SPECDEC_HOST_FEATURES=1`, `specdec.engine.host_features`) on a GPU with
captured graphs: every row's features copied to pinned host memory on a side stream beside the logits. A batch of
two requests, one verifying chains that accept most of their drafts (one slice of rows) and one a tree that accepts
its second branch (rows with a gap), with EAGLE-1 and EAGLE-3 features: tokens equal and features bit-equal to the
device path's, run as the same batches on twin requests; a verify waits for the GPU at most twice."""

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
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    prompts = [list(range(300, 360)), list(range(500, 541))]
    # each prompt's greedy continuation (bf16 on this GPU), for drafts the target accepts
    target.prefill([PrefillInput(f"c{i}", p, params, return_features=False) for i, p in enumerate(prompts)])
    conts = [[target.requests[f"c{i}"].root] for i in range(2)]
    for i, more in enumerate(target.verify([VerifyInput(f"c{i}", [], []) for i in range(2)], plain_steps=60)):
        conts[i] += more.tokens
        target.release(f"c{i}")
    ids = {"dev": ("d0", "d1"), "host": ("h0", "h1")}
    for pair in ids.values():
        target.prefill([PrefillInput(rid, p, params, layers) for rid, p in zip(pair, prompts, strict=True)])
    done = [1, 1]
    for _ in range(5):
        a, b = conts[0][done[0] : done[0] + 3], conts[1][done[1] : done[1] + 2]
        trees = [([*a, 7], [-1, 0, 1, 2]), ([7, b[0], 7, b[1], 7], [-1, -1, 0, 1, 2])]
        dev = target.verify([VerifyInput(rid, *t) for rid, t in zip(ids["dev"], trees, strict=True)])
        host = target.verify([VerifyInput(rid, *t) for rid, t in zip(ids["host"], trees, strict=True)],
                             features_on_host=True)
        for i, (d, h) in enumerate(zip(dev, host, strict=True)):
            assert d.tokens == h.tokens and h.tokens == conts[i][done[i] : done[i] + len(h.tokens)]
            assert d.features.device.type == "cuda" and h.features.device.type == "cpu"
            assert torch.equal(d.features.cpu(), h.features)
            done[i] += len(h.tokens)
    assert reads and done[0] > 10 and done[1] > 8  # staged, and most drafts accepted
    chain = ([*conts[0][done[0] : done[0] + 3], 7], [-1, 0, 1, 2])
    syncs = synchronizing_calls(lambda: target.verify([VerifyInput("h0", *chain)], features_on_host=True))
    assert sum(syncs.values()) <= 2, syncs
    for pair in ids.values():
        for rid in pair:
            target.release(rid)
