"""`serve-draft --target in-process` on one GPU: the draft's process runs the target engine too (flashinfer, CUDA
graphs of both engines in one process) and serves TargetService over it; the draft's greedy output equals that
engine's plain decoding, and both KV pools are whole afterwards."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services"))
from test_two_gpu_services import _spec_and_plain  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("backend,dtype,exact", [("torch", "float32", True), ("flashinfer", "bfloat16", False)])
def test_colocated_draft_and_target_on_one_gpu(backend, dtype, exact, dev_prompts, tiny_tokenizer):
    from services_stack import start_draft

    common = ["--device", "cuda:0", "--attention-backend", backend, "--dtype", dtype, "--num-pages", "2000",
              "--max-batch-size", "16"]
    colocated = start_draft("in-process", *common)
    remote = start_draft(colocated.addr, *common)  # another draft verifying through the colocated TargetService
    try:
        prompts = [tiny_tokenizer.encode(p)[-200:] for p in dev_prompts[:12]]
        spec, plain, freed = asyncio.run(_spec_and_plain(colocated.addr, colocated.addr, prompts, 48))
        far, _, far_freed = asyncio.run(_spec_and_plain(colocated.addr, remote.addr, prompts[:4], 48))
    finally:
        remote.stop()
        colocated.stop()
    assert all(len(s) == 48 for s in spec + far) and freed == far_freed == (True, True)
    same = sum(s == p for s, p in zip(spec + far, plain + plain[:4], strict=True))
    # float32: token for token; bf16: a tree verify and a one-token decode may round a near-tie differently
    assert same == 16 if exact else same >= 16 - 3, same
