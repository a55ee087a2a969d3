"""Where an engine step makes the host wait for the GPU, and what the non-blocking copies save (GPU only).

    python bench/sync_audit.py --out sync_audit.json

1. Audit: one plain call (16 steps), one chain verify, one draft proposal and one draft extend of the 8B shape
   (random weights), each under `torch.cuda.set_sync_debug_mode("warn")`: every synchronizing CUDA call it makes,
   grouped by the line of specdec (or flashinfer) that made it. A plain call should make one (its tokens); a
   verify a few (its verdict); proposal and extend one or none.
2. Side by side in one run: plain decoding tokens/s (target alone, `plain_steps` tokens per call) and the batch-1
   chain-verify step time with the engines' copies non-blocking (the default) and blocking
   (`specdec.host_copy.SYNC_COPIES = True`: every copy of the host's step inputs waits for the GPU, as torch's
   default copies do).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_bench import _decode_rate, _sync_time  # noqa: E402

from specdec import host_copy  # noqa: E402
from specdec.engine.draft_engine import SpecConfig  # noqa: E402
from specdec.engine.factory import EngineOptions, build_draft, build_target  # noqa: E402
from specdec.engine.requests import PrefillInput, VerifyInput  # noqa: E402
from specdec.host_copy import synchronizing_calls  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sync_audit.json")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--plain-steps", default="4,16")
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    opts = EngineOptions(device="cuda", dtype="bfloat16", attention_backend="flashinfer", dummy_weights=True,
                         max_batch_size=max(sizes), max_context=4096, num_pages=8192)
    target = build_target("llama3-8b", opts)
    draft = build_draft("llama3-8b-eagle1", "llama3-8b", SpecConfig(6, 1, 6), opts, target.max_context)
    res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "audit": {}, "rows": []}
    out = Path(args.out)

    # ---- 1. audit ----
    params = SamplingParams(max_new_tokens=100000, ignore_eos=True)
    prompt = list(range(1000, 1512))
    target.prefill([PrefillInput("a", prompt, params, feature_layers=())])
    chain = VerifyInput("a", [7] * 6, list(range(-1, 5)))
    for _ in range(3):  # graphs captured on first use
        target.verify([VerifyInput("a", [], [])], plain_steps=16)
        target.verify([chain])
    res["audit"]["target plain call, 16 steps, bs 1"] = synchronizing_calls(
        lambda: target.verify([VerifyInput("a", [], [])], plain_steps=16))
    res["audit"]["target chain verify, 6 drafts, bs 1"] = synchronizing_calls(lambda: target.verify([chain]))
    draft.add("a", 4000)
    feats = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    draft.extend([("a", prompt, feats)])
    for _ in range(3):
        draft.propose(["a"])
    res["audit"]["draft chain proposal, bs 1"] = synchronizing_calls(lambda: draft.propose(["a"]))

    def extend4():
        n = draft.requests["a"].kv_len
        draft.extend([("a", [5, 6, 7, 8], feats[:4])])
        draft.kv.resize("a", n)
        draft.requests["a"].kv_len = n

    extend4()
    res["audit"]["draft extend, 4 tokens, bs 1"] = synchronizing_calls(extend4)
    target.release("a")
    draft.release("a")
    print(json.dumps(res["audit"], indent=1), flush=True)
    out.write_text(json.dumps(res, indent=1))

    # ---- 2. non-blocking vs blocking copies, side by side ----
    for bs in sizes:
        prompts = [list(range(1000 + i, 1256 + i)) for i in range(bs)]
        for steps in [int(x) for x in args.plain_steps.split(",")]:
            row = {"bs": bs, "plain_steps": steps}
            for label, blocking in (("non_blocking", False), ("blocking", True)):
                host_copy.SYNC_COPIES = blocking
                rate, _ = _decode_rate(target, None, prompts, args.new_tokens, plain_steps=steps)
                row[f"{label}_tok_s"] = round(rate, 1)
            host_copy.SYNC_COPIES = False
            row["ratio"] = round(row["non_blocking_tok_s"] / row["blocking_tok_s"], 3)
            res["rows"].append(row)
            print("PLAIN", row, flush=True)
            out.write_text(json.dumps(res, indent=1))
    target.prefill([PrefillInput("v", prompt, params, feature_layers=())])
    for label, blocking in (("non_blocking", False), ("blocking", True)):
        host_copy.SYNC_COPIES = blocking
        t, _ = _sync_time(lambda: target.verify([VerifyInput("v", [7] * 6, list(range(-1, 5)))]), 50)
        res[f"verify_chain6_bs1_ms_{label}"] = round(t * 1e3, 3)
    host_copy.SYNC_COPIES = False
    print({k: v for k, v in res.items() if k.startswith("verify")}, flush=True)
    out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
