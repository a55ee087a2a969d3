"""The target service's verifies copy every row's features to pinned host memory on a side stream beside the
logits (`specdec.engine.host_features`): on a GPU with captured graphs the tokens and features equal the device
path's bit for bit, and the step still waits for the GPU once for its verdict plus once for the copy."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("layers", [(), (1, 2)])
def test_features_on_host_equal_the_device_path_on_gpu(layers):
    from repo_paths import TINY

    from specdec.engine.factory import EngineOptions, build_target
    from specdec.engine.requests import PrefillInput, VerifyInput
    from specdec.host_copy import synchronizing_calls
    from specdec.sampling_params import SamplingParams

    target = build_target(str(TINY / "target"), EngineOptions(device="cuda", dtype="bfloat16",
                                                              attention_backend="flashinfer", num_pages=512,
                                                              max_batch_size=8))
    assert target.graphs is not None
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    prompt = list(range(300, 360))
    target.prefill([PrefillInput(rid, prompt, params, layers) for rid in ("dev", "host")])
    chain, tree = ([5, 6, 7, 8, 9], [-1, 0, 1, 2, 3]), ([5, 6, 7, 8, 9, 10], [-1, -1, 0, 0, 2, 1])
    for step in range(6):
        tokens, parents = chain if step % 2 else tree
        dev = target.verify([VerifyInput("dev", tokens, parents)])[0]
        host = target.verify([VerifyInput("host", tokens, parents)], features_on_host=True)[0]
        assert dev.tokens == host.tokens
        assert dev.features.device.type == "cuda" and host.features.device.type == "cpu"
        assert host.features.is_pinned()
        assert torch.equal(dev.features.cpu(), host.features)
    syncs = synchronizing_calls(lambda: target.verify([VerifyInput("host", *chain)], features_on_host=True))
    assert sum(syncs.values()) <= 2, syncs
    for rid in ("dev", "host"):
        target.release(rid)
