"""Prometheus metrics of one service, on its own registry, served over HTTP.

    metrics = ServiceMetrics("draft", model_name=model_label(args.model))  # all family groups
    metrics = ServiceMetrics("gateway", model_name="target", families={"requests", "running"})
    start_metrics_server(args.metrics_port, metrics.registry)   # port 0: no server
    metrics.observe_spec_step(num_drafts=4, num_draft_tokens=32, accepted_per_pos=[4, 3, 1])

Names follow vLLM's (`vllm:` -> `specdec:`). prometheus_client appends `_total` to a counter's name when it
exposes it, exactly as it does for vLLM's counters, so the scraped names are vLLM's with the new prefix:
`specdec:spec_decode_num_drafts_total`, `specdec:requests_total`, ... (docs/observability.md lists them all).
Every series carries `service` and `model_name` labels. A service registers only the family groups it sets
(`FAMILY_GROUPS`), so a scrape never shows a gauge stuck at 0 that nothing updates.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specdec.errors import ConfigError
from specdec.telemetry.metrics_http import serve_text_metrics

logger = logging.getLogger(__name__)

# Bucket upper bounds in seconds (vLLM's, with finer steps below 10 ms: speculation makes tokens cheap).
TTFT_BUCKETS_S = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
TPOT_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
E2E_BUCKETS_S = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)
# one phase of a decode step (a draft's propose, a target's forward): 100 us .. 10 s
PHASE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                   0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 10.0)

PREFIX = "specdec:"
BASE_LABELS = ("service", "model_name")
# the families a service may register, by group: each service asks for the groups it sets (`families=`)
FAMILY_GROUPS = {
    "requests": ("requests", "request_errors", "time_to_first_token_seconds", "time_per_output_token_seconds",
                 "e2e_request_latency_seconds", "prompt_tokens", "generation_tokens"),  # observe_request, count_tokens
    "running": ("num_requests_running",),  # set_running, track(running=)
    "waiting": ("num_requests_waiting",),  # set_waiting, track(waiting=)
    "kv": ("kv_pages_used", "kv_pages_free", "kv_pages_unreserved"),  # set_kv, track(kv_pages=)
    "batch": ("batch_size",),  # observe_batch
    "spec": ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
             "spec_decode_num_accepted_tokens_per_pos", "speculation_policy_tokens_per_second",
             "speculation_policy_target_steps"),  # observe_spec_step, track_policy
    "phases": ("step_phase_seconds",),  # observe_phase
    "fallbacks": ("request_fallbacks",),  # count_fallbacks (the gateway)
    "engine": ("engine_busy_seconds",),  # track(engine_busy=)
}
ALL_FAMILIES = frozenset(FAMILY_GROUPS)
MODEL_FAMILIES = ALL_FAMILIES - {"fallbacks"}  # what a model service may set (a fallback is the gateway's)


def model_label(model: str) -> str:
    """The `model_name` label for a checkpoint directory (its name: `models/tiny-code/target` -> `target`) or a
    `--config` preset name (itself)."""
    return Path(model).name


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str = "0.0.0.0",
                         grpc_port: int | None = None) -> Any | None:
    """Serve `registry` at http://addr:port/metrics from a daemon thread, in the text format whatever the scraper
    asks (`metrics_http`); port 0 = no server (returns None).
    `addr`: the service's own `--host` (a service kept on loopback keeps its metrics there too). A port that
    cannot be had is a ConfigError (the CLI's `error: ...` and exit 2, like a busy gRPC port), and so is the
    service's own gRPC port (`grpc_port`: said as such, not as "another process").

    Returns the HTTP server (call `.shutdown()` to stop it).
    """
    if port == 0:
        return None
    if port == grpc_port:
        raise ConfigError(f"--metrics-port {port} is also this service's --port: give the metrics a port of their own")
    try:
        server = serve_text_metrics(port, addr, registry)
    except OSError as exc:
        raise ConfigError(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}") from None
    logger.info("metrics on http://%s:%d/metrics", addr, port)
    return server


class ServiceMetrics:
    """The metrics one service records; each method is cheap enough to call once per step or request.

    `families`: the groups of `FAMILY_GROUPS` to register (default all); the methods of a group left out raise
    `LookupError`, so a service that registers too little fails in its tests, not with a silent 0 in production.
    """

    def __init__(self, service: str, model_name: str = "", registry: CollectorRegistry | None = None,
                 families: Collection[str] = ALL_FAMILIES, sibling_of: ServiceMetrics | None = None) -> None:
        """`sibling_of`: another service's metrics in the same process (a draft's in-process target): the same
        registry and families, these series told apart by their `service` label."""
        unknown = set(families) - ALL_FAMILIES
        if unknown:
            raise ValueError(f"unknown metric family groups {sorted(unknown)}; known: {sorted(ALL_FAMILIES)}")
        if sibling_of is not None:
            registry = sibling_of.registry
        self.registry = registry if registry is not None else CollectorRegistry()
        self.families = frozenset(families)
        # name -> the family (unlabelled), shared with siblings: a registry takes each name once
        self._made: dict[str, Any] = sibling_of._made if sibling_of is not None else {}
        base = (service, model_name)

        def make(group: str, kind: type, name: str, doc: str, extra: Sequence[str] = (), **kwargs: Any) -> Any:
            if group not in self.families:
                return _Unregistered(service, group)
            metric = self._made.get(name)
            if metric is None:
                metric = self._made[name] = kind(PREFIX + name, doc, (*BASE_LABELS, *extra), registry=self.registry,
                                                 **kwargs)
            return metric if extra else metric.labels(*base)

        self._base = base
        self._requests = make("requests", Counter, "requests", "Finished requests by gRPC status name.", ("status",))
        self._errors = make("requests", Counter, "request_errors", "Failed requests by gRPC status name.", ("code",))
        self._ttft = make("requests", Histogram, "time_to_first_token_seconds", "Time to first token.",
                          buckets=TTFT_BUCKETS_S)
        self._tpot = make("requests", Histogram, "time_per_output_token_seconds",
                          "Mean time per output token after the first, per request.", buckets=TPOT_BUCKETS_S)
        self._e2e = make("requests", Histogram, "e2e_request_latency_seconds", "End-to-end request latency.",
                         buckets=E2E_BUCKETS_S)
        self._prompt_tokens = make("requests", Counter, "prompt_tokens",
                                   "Prompt tokens of the requests served (vLLM's prompt_tokens_total).")
        self._generation_tokens = make("requests", Counter, "generation_tokens",
                                       "Tokens generated and sent, cancelled requests' included (vLLM's "
                                       "generation_tokens_total).")
        self._running = make("running", Gauge, "num_requests_running", "Requests in the running batch.")
        self._waiting = make("waiting", Gauge, "num_requests_waiting", "Requests queued, not yet running.")
        self._kv_used = make("kv", Gauge, "kv_pages_used", "KV cache pages in use.")
        self._kv_free = make("kv", Gauge, "kv_pages_free", "KV cache pages not written by any request.")
        self._kv_unreserved = make("kv", Gauge, "kv_pages_unreserved",
                                   "KV cache pages no admitted request has reserved (near 0: the pool is full).")
        self._batch = make("batch", Histogram, "batch_size", "Requests per step.", buckets=BATCH_SIZE_BUCKETS)
        self._drafts = make("spec", Counter, "spec_decode_num_drafts", "Drafts proposed (one per request per step).")
        self._draft_tokens = make("spec", Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self._accepted = make("spec", Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._accepted_per_pos = make("spec", Counter, "spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by position (depth) in the draft.", ("position",))
        self._per_pos_children: list[Any] = []
        self._phase = make("phases", Histogram, "step_phase_seconds", "Seconds of one phase of a decode step "
                           "(draft: propose, verify round trip, extend, the whole step; target: a Verify's queue "
                           "wait, forward, reply packing).", ("phase",), buckets=PHASE_BUCKETS_S)
        self._phase_children: dict[str, Any] = {}
        self._engine_busy = make("engine", Gauge, "engine_busy_seconds",
                                 "Seconds the engine thread has been in its current step or batch of calls (0 while "
                                 "it waits for work); past --engine-stall-seconds the service reports itself stalled.")
        self._fallbacks = make("fallbacks", Counter, "request_fallbacks",
                               "Times a finished request's stream continued on another service after one under it "
                               "failed (GatewayStats.fallbacks).")

    @property
    def base_labels(self) -> tuple[str, str]:
        """This service's values of BASE_LABELS (`service`, `model_name`): for a collector of its own that joins
        `registry` (the gateway's `pair_part_up`)."""
        return self._base

    def observe_request(
        self,
        status: str,
        ttft_s: float | None = None,
        tpot_s: float | None = None,
        e2e_s: float | None = None,
    ) -> None:
        """One finished request. `status` is a gRPC status name ("OK", "CANCELLED", ...) or a StatusCode;
        latencies that do not apply (no token produced, a single token) are None."""
        status = getattr(status, "name", status)
        self._requests.labels(*self._base, status).inc()
        if status != "OK":
            self._errors.labels(*self._base, status).inc()
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
        if tpot_s is not None:
            self._tpot.observe(tpot_s)
        if e2e_s is not None:
            self._e2e.observe(e2e_s)

    def count_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        """One request's prompt tokens and the tokens generated for it (those sent before it ended, whatever its
        status): `rate(specdec:generation_tokens_total[1m])` is the service's output tokens/s."""
        if prompt_tokens > 0:
            self._prompt_tokens.inc(prompt_tokens)
        if generation_tokens > 0:
            self._generation_tokens.inc(generation_tokens)

    def count_fallbacks(self, n: int) -> None:
        self._fallbacks.inc(n)

    def set_running(self, n: int) -> None:
        self._running.set(n)

    def set_waiting(self, n: int) -> None:
        self._waiting.set(n)

    def set_kv(self, used: int, free: int, unreserved: int | None = None) -> None:
        self._kv_used.set(used)
        self._kv_free.set(free)
        self._kv_unreserved.set(free if unreserved is None else unreserved)

    def track(
        self,
        kv_pages: Callable[[], tuple[int, ...]] | None = None,
        running: Callable[[], int] | None = None,
        waiting: Callable[[], int] | None = None,
        engine_busy: Callable[[], float] | None = None,
    ) -> None:
        """Read gauges when scraped instead of setting them: `kv_pages() -> (used, free[, unreserved])`
        (`PagedKVCache.gauges`; without unreserved it reads as free), `running()`, `waiting()`, `engine_busy()`
        (`EngineLoop.busy_s`). They run on the scrape thread, so they should only read plain counters (a `len`)."""
        if kv_pages is not None:
            self._kv_used.set_function(lambda: kv_pages()[0])
            self._kv_free.set_function(lambda: kv_pages()[1])
            self._kv_unreserved.set_function(lambda: kv_pages()[-1])
        if running is not None:
            self._running.set_function(running)
        if waiting is not None:
            self._waiting.set_function(waiting)
        if engine_busy is not None:
            self._engine_busy.set_function(engine_busy)

    def track_policy(self, policy) -> None:
        """Expose `--speculation auto`'s measured rates when scraped: `speculation_policy_tokens_per_second
        {batch_bucket, budget}` (what each budget delivered lately at that batch size, the numbers it chooses
        by)."""
        if "spec" not in self.families:
            raise _unregistered(self._base[0], "spec")
        self.registry.register(_PolicyCollector(policy, self._base))

    def observe_batch(self, n: int) -> None:
        self._batch.observe(n)

    def observe_phase(self, phase: str, seconds: float) -> None:
        """Time of one phase of a step (`phase` is one of a few fixed names: see docs/observability.md)."""
        child = self._phase_children.get(phase)
        if child is None:
            child = self._phase_children[phase] = self._phase.labels(*self._base, phase)
        child.observe(seconds)

    def observe_spec_step(
        self, num_drafts: int, num_draft_tokens: int, accepted_per_pos: Sequence[int]
    ) -> None:
        """One verify step: `num_drafts` requests' drafts, `num_draft_tokens` draft tokens in all of them, and
        `accepted_per_pos[i]` = how many of the drafts had their token at depth i + 1 accepted (bonus tokens
        are not draft tokens and are not counted). Example: 2 drafts accepting 3 and 1 -> [2, 1, 1]."""
        self._drafts.inc(num_drafts)
        self._draft_tokens.inc(num_draft_tokens)
        self._accepted.inc(sum(accepted_per_pos))
        children = self._per_pos_children
        while len(children) < len(accepted_per_pos):
            children.append(self._accepted_per_pos.labels(*self._base, str(len(children))))
        for child, count in zip(children, accepted_per_pos, strict=False):
            if count:
                child.inc(count)


def _unregistered(service: str, group: str) -> LookupError:
    return LookupError(f"{service!r} metrics were built without the {group!r} family group (ServiceMetrics("
                       "families=...))")


class _Unregistered:
    """Stands in for the metrics of a family group the service did not register: any use raises."""

    def __init__(self, service: str, group: str) -> None:
        self.service, self.group = service, group

    def __getattr__(self, attr: str) -> Any:
        raise _unregistered(self.service, self.group)


class _PolicyCollector:
    """Reads a `SpeculationPolicy` at scrape time (its dicts are copied whole: the engine thread updates them)."""

    def __init__(self, policy, base: tuple[str, str]) -> None:
        self.policy, self.base = policy, base

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from specdec.engine.adaptive import budget_name

        rates = GaugeMetricFamily(PREFIX + "speculation_policy_tokens_per_second",
                                  "--speculation auto: tokens/s each budget measured at a batch-size bucket.",
                                  labels=(*BASE_LABELS, "batch_bucket", "budget"))
        for (bucket, budget), rate in sorted(dict(self.policy.rates).items()):
            rates.add_metric((*self.base, str(bucket), budget_name(budget)), rate)
        steps = CounterMetricFamily(PREFIX + "speculation_policy_target_steps",
                                    "--speculation auto: target steps run with each budget (a plain call of k "
                                    "steps counts k).", labels=(*BASE_LABELS, "budget"))
        for budget, n in sorted(dict(self.policy.target_steps).items()):
            steps.add_metric((*self.base, budget_name(budget)), n)
        return [rates, steps]

    def describe(self):
        return []  # registered without a description: collected only when scraped
