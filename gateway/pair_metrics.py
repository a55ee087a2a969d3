"""`specdec:pair_part_up{pair, part}`: whether each part of each pair is up (1) or down (0), read when scraped.

    track_pair_parts(metrics, router)   # once, after start: the gauge joins the gateway's registry

One series per part: `pair` is the pair as `--pair` names it (`DRAFT=TARGET`, `=TARGET` without a draft), `part`
`draft` or `target`; a pair without a draft has no draft series. A part is down until its first health check
finds it SERVING, and from a failed call (`Router.report_failure`) until a check finds it SERVING again.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

from gateway.router import Part, Router
from specdec.telemetry import ServiceMetrics
from specdec.telemetry.metrics import BASE_LABELS, PREFIX

NAME = PREFIX + "pair_part_up"


class PairPartsCollector:
    """Reads the router's pairs at scrape time (plain bools: safe from the scrape thread)."""

    def __init__(self, router: Router, base: tuple[str, str]) -> None:
        self.router, self.base = router, base

    def collect(self):
        gauge = GaugeMetricFamily(NAME, "1 while a pair's draft or target is up (its last health check answered "
                                  "SERVING and no call failed since), else 0.", labels=(*BASE_LABELS, "pair", "part"))
        for pair in self.router.pairs:
            parts = (Part.DRAFT, Part.TARGET) if pair.draft is not None else (Part.TARGET,)
            for part in parts:
                gauge.add_metric((*self.base, str(pair.address), part.value), float(pair.is_up(part)))
        return [gauge]

    def describe(self):
        return []  # registered without a description: collected only when scraped


def track_pair_parts(metrics: ServiceMetrics, router: Router) -> None:
    """Expose the router's part states on `metrics`' registry, under its `service` and `model_name` labels."""
    metrics.registry.register(PairPartsCollector(router, metrics.base_labels))
