"""What a first request meets: the README's first command (`specdec generate`) over several prompts, each on a fresh
local stack (target, draft and gateway processes on free ports, the bundled tiny pair, CPU unless --device), so
every request starts with a cold `--speculation auto` policy (its start-up calibration only). Prints each
request's (tau, tokens/s) and their means.

    python bench/fresh_stack.py [--prompts 10] [--new-tokens 128] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.client import GatewayClient  # noqa: E402
from gateway.local_stack import LocalStack, StackConfig  # noqa: E402

DEV_PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "prompts" / "dev.jsonl"
BUNDLED = ["def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:\n    def __init__(self):"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=10, help="how many prompts (the first of dev.jsonl)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    if DEV_PROMPTS.exists():
        prompts = [json.loads(line)["prompt"] for line in DEV_PROMPTS.open()][: args.prompts]
    else:
        prompts = BUNDLED[: args.prompts]
    runs = []
    for prompt in prompts:
        with tempfile.TemporaryDirectory(prefix="specdec-bench-") as logs:
            stack = LocalStack(StackConfig.free_ports(device=args.device), logs)
            stack.start(180)
            try:
                with GatewayClient(stack.gateway_addr) as client:
                    stream = client.generate(prompt, max_new_tokens=args.new_tokens)
                    "".join(stream)
                    runs.append((round(stream.stats.tau, 2), round(stream.stats.tokens_per_s, 1)))
            finally:
                stack.stop()
        print(runs[-1], flush=True)
    n = len(runs)
    tau, rate = sum(r[0] for r in runs) / n, sum(r[1] for r in runs) / n
    print(f"{n} fresh stacks: mean {rate:.1f} tokens/s, mean tau {tau:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
