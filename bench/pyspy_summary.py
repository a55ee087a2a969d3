"""Summarise a `py-spy record --subprocesses --threads --format raw` profile as text: samples per process and
thread, then per thread the functions with the most samples inclusive and on top of the stack (self).

    py-spy record --subprocesses --threads --format raw -o prof.txt -- python bench/services_bench.py ...
    python bench/pyspy_summary.py prof.txt [--top 25] [--under _verify_many]

`--under NAME` keeps only stacks that pass through a frame whose function is NAME (e.g. one phase of a step).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

_SERVICE = re.compile(r"specdec (serve-[a-z]+)")
_FRAME = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")


def parse_line(line: str) -> tuple[str, str, list[str], int] | None:
    """(process label, thread label, frames without line numbers, samples) of one raw line."""
    stack, _, count = line.rpartition(" ")
    if not stack or not count.isdigit():
        return None
    parts = stack.split(";")
    procs = [p for p in parts if p.startswith("process ")]
    thread = next((p for p in parts if p.startswith("thread ")), "thread ?")
    frames = [p for p in parts if not p.startswith(("process ", "thread "))]
    service = _SERVICE.search(procs[-1]) if procs else None
    proc = service.group(1) if service else ("bench" if procs else "?")
    name = thread.split(":", 1)[1].strip() if ":" in thread else thread
    return proc, name, [_short(f) for f in frames], int(count)


def _short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    func, path = m.groups()
    return f"{func} ({'/'.join(Path(path).parts[-2:])})"


def summarise(lines, top: int, under: str | None) -> str:
    threads: Counter = Counter()
    inclusive: dict[tuple, Counter] = {}
    self_: dict[tuple, Counter] = {}
    for line in lines:
        parsed = parse_line(line.rstrip("\n"))
        if parsed is None:
            continue
        proc, thread, frames, n = parsed
        if under is not None:
            idx = next((i for i, f in enumerate(frames) if f.split(" (")[0] == under), None)
            if idx is None:
                continue
            frames = frames[idx:]
        key = (proc, thread)
        threads[key] += n
        inc = inclusive.setdefault(key, Counter())
        for f in set(frames):
            inc[f] += n
        if frames:
            self_.setdefault(key, Counter())[frames[-1]] += n
    out = ["samples per process / thread:"]
    out += [f"  {n:7d}  {p} / {t}" for (p, t), n in threads.most_common()]
    for key, total in threads.most_common():
        if total < 0.02 * sum(threads.values()):
            continue
        out.append(f"\n== {key[0]} / {key[1]}: {total} samples; inclusive (top {top})")
        out += [f"  {100 * n / total:5.1f}%  {f}" for f, n in inclusive[key].most_common(top)]
        out.append("   -- self")
        out += [f"  {100 * n / total:5.1f}%  {f}" for f, n in self_.get(key, Counter()).most_common(top)]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("profile", type=Path)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--under", default=None, help="keep only stacks through a frame of this function")
    args = p.parse_args(argv)
    with args.profile.open() as f:
        print(summarise(f, args.top, args.under))
    return 0


if __name__ == "__main__":
    sys.exit(main())
