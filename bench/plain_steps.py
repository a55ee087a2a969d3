"""Plain decoding through the Verify RPC: one call per token vs several plain steps per call (`plain_steps`), next
to the target's own `Generate` (CPU, shipped tiny target as its own process, like the services run it). This is
what a draft service pays while `--speculation auto` decodes plainly.

    python bench/plain_steps.py [--batch 1] [--tokens 96] [--steps 1,4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

from service_process import ServiceProcess  # noqa: E402

TINY = REPO_ROOT / "models" / "tiny-code"
PROMPT = list(range(100, 164))


def _verify_rate(client, batch: int, tokens: int, steps: int, tag: str) -> float:
    """Tokens/s of `batch` requests decoding `tokens` tokens each through Verify calls of `steps` plain steps."""
    from specdec.engine.requests import PrefillInput, VerifyInput
    from specdec.sampling_params import SamplingParams

    rids = [f"{tag}-{i}" for i in range(batch)]
    client.prefill([PrefillInput(rid, PROMPT, SamplingParams(max_new_tokens=tokens + 1, ignore_eos=True))
                    for rid in rids])
    done = 0
    t0 = time.perf_counter()
    while done < tokens:
        outs = client.verify([VerifyInput(rid, [], []) for rid in rids], plain_steps=steps)
        done += len(outs[0].tokens)
    elapsed = time.perf_counter() - t0
    for rid in rids:
        client.release(rid)
    return batch * done / elapsed


def _generate_rate(addr: str, batch: int, tokens: int, tag: str) -> float:
    import grpc

    from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc

    def one(i: int) -> int:
        with grpc.insecure_channel(addr) as ch:
            req = target_pb2.TargetServiceGenerateRequest(
                request_id=f"{tag}-{i}", prompt_ids=PROMPT,
                sampling=common_pb2.SamplingParams(max_new_tokens=tokens, ignore_eos=True))
            return sum(len(m.token_ids) for m in target_pb2_grpc.TargetServiceStub(ch).Generate(req))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        total = sum(pool.map(one, range(batch)))
    return total / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--steps", default="1,4", help="plain steps per Verify call to compare")
    p.add_argument("--repeats", type=int, default=3, help="runs of each, alternating; the best is kept")
    args = p.parse_args(argv)
    from draft_service.target_client import TargetClient

    target = ServiceProcess(["serve-target", "--model", str(TINY / "target"), "--log-level", "WARNING"],
                            "specdec.v1.TargetService")
    client = TargetClient(target.addr)
    best: dict[str, float] = {}
    try:
        _verify_rate(client, args.batch, 8, 1, "warm")
        for r in range(args.repeats):
            for steps in [int(x) for x in args.steps.split(",")]:
                rate = _verify_rate(client, args.batch, args.tokens, steps, f"v{steps}-{r}")
                best[f"verify_plain_steps_{steps}"] = max(best.get(f"verify_plain_steps_{steps}", 0.0), rate)
            rate = _generate_rate(target.addr, args.batch, args.tokens, f"g{r}")
            best["target_generate"] = max(best.get("target_generate", 0.0), rate)
    finally:
        client.close()
        target.stop()
    rates = {k: round(v, 1) for k, v in best.items()}
    print(json.dumps(dict(batch=args.batch, tokens=args.tokens, tokens_per_s=rates)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
