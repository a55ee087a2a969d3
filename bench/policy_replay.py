"""Replay the plain-decoding records of a draft's policy history (`SPECDEC_POLICY_HISTORY=FILE specdec serve-draft
...`, written at shutdown) through the policy's rate estimate, with and without the clipped excess given back
(`SpeculationPolicy._clip`), and compare each with the real rate of the last 40 records (tokens / seconds).

    python bench/policy_replay.py HISTORY_FILE

Under CPU contention pipelined plain calls land in pairs (238 ms, then 3 ms: the second call was done while the
first landed); clipping the long one alone over-rated plain decoding (twenty-fifth pass, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.engine.adaptive import SpeculationPolicy  # noqa: E402


class ClipOnly(SpeculationPolicy):
    """The estimate before the twenty-fifth pass: a long sample clipped, its excess dropped."""

    def _clip(self, key, step_s):
        return min(step_s, self.max_step_ratio * self.seconds[key])


class NoClip(SpeculationPolicy):
    def _clip(self, key, step_s):
        return step_s


def estimates(cls, plain: list) -> list[float]:
    policy, out = cls(budgets=(0,)), []
    for _, bs, _, tokens, seconds, steps, yielding, chosen, _ in plain:
        policy.record(bs, 0, tokens, seconds, steps, yielding, chosen)
        out.append(policy.rates.get((policy.bucket(chosen or bs), 0), 0.0))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("history")
    ap.add_argument("--window", type=int, default=40)
    args = ap.parse_args()
    rows = [json.loads(line) for line in Path(args.history).read_text().splitlines() if line.strip()]
    plain = [r for r in rows if r[0] == "step" and r[2] == 0]
    w = args.window
    truth = [sum(r[3] for r in plain[i - w:i]) / sum(r[4] for r in plain[i - w:i]) for i in range(w, len(plain))]
    print(f"{len(plain)} plain records")
    for name, cls in (("clip only (before)", ClipOnly), ("clip, excess given back (now)", SpeculationPolicy),
                      ("no clip", NoClip)):
        est = estimates(cls, plain)
        ratio = [est[i - 1] / truth[i - w] for i in range(w, len(plain))]
        print(f"{name:32s} estimate / real: mean {statistics.mean(ratio):.3f}, sd {statistics.pstdev(ratio):.3f}, "
              f"max {max(ratio):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
