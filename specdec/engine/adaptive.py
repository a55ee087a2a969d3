"""Adaptive speculation: per step, speculate or decode plainly, whichever has recently delivered more tokens per
second at this batch size (both are lossless: a plain step is a verify of empty trees).

Throughput is measured, not modelled: each step records (batch size, mode, tokens committed, seconds) and the
policy keeps an exponential moving average of tokens/s per (batch-size bucket, mode). A bucket tries each mode
before trusting either, and keeps re-measuring the losing mode, so a change in acceptance (a new prompt mix) or
load moves the choice. Re-measuring costs (a speculative step after plain ones first extends the draft over the
backlog), so the interval backs off: it starts at `explore_every` steps, doubles (up to `max_explore_every`) each
time a re-measurement confirms the choice, and resets when one overturns it. Buckets are powers of two.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpeculationPolicy:
    explore_every: int = 16  # first interval (in steps) between re-measurements of the mode not chosen
    max_explore_every: int = 256
    ema: float = 0.3  # weight of the newest measurement
    min_samples: int = 3  # steps of each mode before the averages decide (the first one only warms up)
    rates: dict[tuple[int, bool], float] = field(default_factory=dict)  # (bucket, speculative) -> tokens/s
    samples: dict[tuple[int, bool], int] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    intervals: dict[int, int] = field(default_factory=dict)  # bucket -> current re-measurement interval
    since: dict[int, int] = field(default_factory=dict)  # bucket -> steps since the last re-measurement
    challenged: dict[int, bool] = field(default_factory=dict)  # bucket -> the choice a pending re-measurement tests

    @staticmethod
    def bucket(batch_size: int) -> int:
        return 1 << max(0, batch_size - 1).bit_length()

    def choose(self, batch_size: int) -> bool:
        """True: speculate this step; False: decode plainly."""
        b = self.bucket(batch_size)
        n = self.steps.get(b, 0)
        self.steps[b] = n + 1
        for mode in (True, False):
            if self.samples.get((b, mode), 0) < self.min_samples:
                return mode
        best = self._best(b)
        since = self.since.get(b, 0) + 1
        if since >= self.intervals.get(b, self.explore_every):
            self.since[b], self.challenged[b] = 0, best
            return not best
        self.since[b] = since
        return best

    def _best(self, b: int) -> bool:
        return self.rates[(b, True)] >= self.rates[(b, False)]

    def record(self, batch_size: int, speculative: bool, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        key = (self.bucket(batch_size), speculative)
        rate = tokens / seconds
        old = self.rates.get(key)
        first_real = self.samples.get(key, 0) == 1  # sample 0 (lazy inits, graph capture) is overwritten
        self.rates[key] = rate if old is None or first_real else (1 - self.ema) * old + self.ema * rate
        self.samples[key] = self.samples.get(key, 0) + 1
        b = key[0]
        if b in self.challenged and speculative != self.challenged[b]:  # the re-measurement came back
            held = self._best(b) == self.challenged.pop(b)
            interval = self.intervals.get(b, self.explore_every)
            self.intervals[b] = min(2 * interval, self.max_explore_every) if held else self.explore_every

    def summary(self) -> dict[str, float]:
        return {f"bs{b}-{'spec' if s else 'plain'}": round(r, 1) for (b, s), r in sorted(self.rates.items())}
