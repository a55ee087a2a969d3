"""The fixed cost of one Verify RPC (CPU, shipped tiny pair): the target service as its own process, the draft's
TargetClient in this one, one request verifying a chain per call. Reported per call: the round trip the client
sees, the target's queue / forward / reply phases (scraped from its metrics), and the rest (both ends' gRPC and
protobuf work, the hand-offs between each service's event loop and engine thread).

    python bench/verify_rtt.py [--calls 200] [--chain 5] [--batch 1]
    python bench/verify_rtt.py --batch 128 --plain-steps 4 [--no-features] [--client-device cuda:1] \
        --target-flags "--load-format dummy --config llama3-8b --device cuda:0 --attention-backend flashinfer ..."

`--plain-steps K`: each call is K plain decode steps of empty trees (what `--speculation auto` and `off` send
when they decode plainly) instead of a chain; `--no-features`: the requests ask for no features (as `off` does),
so the difference between the two runs is what the features cost a plain call; `--client-device`: where the
client puts the features it receives (a draft's GPU).
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
    p.add_argument("--plain-steps", type=int, default=0, help="K > 0: calls of K plain steps instead of a chain")
    p.add_argument("--no-features", action="store_true", help="requests ask for no features")
    p.add_argument("--client-device", default=None, help="where received features go (e.g. cuda:1)")
    args = p.parse_args(argv)

    from draft_service.target_client import TargetClient
    from specdec.engine.requests import PrefillInput, VerifyInput
    from specdec.sampling_params import SamplingParams

    target = ServiceProcess(["serve-target", "--model", str(TINY / "target"), "--log-level", "WARNING",
                             *args.target_flags.split()], "specdec.v1.TargetService")
    features = not args.no_features
    client = TargetClient(target.addr, device=args.client_device, features=features)
    try:
        client.model_info()  # as a draft does: Verify then goes over the target's verify lane when it has one
        rids = [f"r{i}" for i in range(args.batch)]
        # enough for every call's tokens, no more: the target reserves KV pages for max_new_tokens up front
        per_call = max(args.plain_steps, args.chain + 1)
        sampling = SamplingParams(max_new_tokens=(args.calls + 10) * per_call + 16, ignore_eos=True)
        client.prefill([PrefillInput(rid, list(range(100, 164)), sampling, (), features) for rid in rids])
        if args.plain_steps:
            tree, more = [VerifyInput(rid, [], []) for rid in rids], {"plain_steps": args.plain_steps}
        else:
            chain = list(range(-1, args.chain - 1))
            tree, more = [VerifyInput(rid, [200 + i for i in range(args.chain)], chain) for rid in rids], {}
        for _ in range(10):  # warm-up
            client.verify(tree, **more)
        before = target.scrape()
        rtts, short = [], 0
        for _ in range(args.calls):
            t0 = time.perf_counter()
            outs = client.verify(tree, **more)
            rtts.append(time.perf_counter() - t0)
            # a request at its context's end gets fewer tokens (none at all once finished): such calls are cheap
            short += any(len(o.tokens) < args.plain_steps for o in outs) if args.plain_steps else 0
        after = target.scrape()
    finally:
        client.close()
        target.stop()
    if short:  # they would pull the means down (300 calls of 16 steps from a 64-token prompt pass the tiny
        # target's 2048-token context after ~124 calls, and the median call read 1.4 ms against ~7 for a real one)
        print(f"{short} of {args.calls} calls decoded fewer than {args.plain_steps} tokens (the requests reached "
              "their context): use fewer --calls or fewer --plain-steps, or a larger --max-context in "
              "--target-flags", file=sys.stderr)
        return 2
    ms = lambda s: round(1000 * s / args.calls, 3)  # noqa: E731
    side = {ph: after.phase_sum(ph) - before.phase_sum(ph) for ph in ("queue", "forward", "reply")}
    row = dict(batch=args.batch, chain=0 if args.plain_steps else args.chain, plain_steps=args.plain_steps,
               features=features, calls=args.calls, rtt_mean_ms=ms(sum(rtts)),
               rtt_median_ms=round(1000 * statistics.median(rtts), 3), **{f"{k}_ms": ms(v) for k, v in side.items()},
               rest_ms=ms(sum(rtts) - sum(side.values())))
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
