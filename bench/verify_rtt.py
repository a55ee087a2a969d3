"""The fixed cost of one Verify RPC (CPU, shipped tiny pair): the target service as its own process, the draft's
TargetClient in this one, one request verifying a chain per call. Reported per call: the round trip the client
sees, the target's queue / forward / reply phases (scraped from its metrics), and the rest (both ends' gRPC and
protobuf work, the hand-offs between each service's event loop and engine thread).

    python bench/verify_rtt.py [--calls 200] [--chain 5] [--batch 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

from service_process import ServiceProcess  # noqa: E402

TINY = REPO_ROOT / "models" / "tiny-code"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--chain", type=int, default=5)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--target-flags", default="", help="more flags for serve-target")
    args = p.parse_args(argv)

    from draft_service.target_client import TargetClient
    from specdec.engine.requests import PrefillInput, VerifyInput
    from specdec.sampling_params import SamplingParams

    target = ServiceProcess(["serve-target", "--model", str(TINY / "target"), "--log-level", "WARNING",
                             *args.target_flags.split()], "specdec.v1.TargetService")
    client = TargetClient(target.addr)
    try:
        rids = [f"r{i}" for i in range(args.batch)]
        sampling = SamplingParams(max_new_tokens=100000, ignore_eos=True)
        client.prefill([PrefillInput(rid, list(range(100, 164)), sampling) for rid in rids])
        chain = list(range(-1, args.chain - 1))
        tree = [VerifyInput(rid, [200 + i for i in range(args.chain)], chain) for rid in rids]
        for _ in range(10):  # warm-up
            client.verify(tree)
        before = target.scrape()
        rtts = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            client.verify(tree)
            rtts.append(time.perf_counter() - t0)
        after = target.scrape()
    finally:
        client.close()
        target.stop()
    ms = lambda s: round(1000 * s / args.calls, 3)  # noqa: E731
    side = {ph: after.phase_sum(ph) - before.phase_sum(ph) for ph in ("queue", "forward", "reply")}
    row = dict(batch=args.batch, chain=args.chain, calls=args.calls, rtt_mean_ms=ms(sum(rtts)),
               rtt_median_ms=round(1000 * statistics.median(rtts), 3), **{f"{k}_ms": ms(v) for k, v in side.items()},
               rest_ms=ms(sum(rtts) - sum(side.values())))
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
