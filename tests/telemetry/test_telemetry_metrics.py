"""ServiceMetrics scraped over HTTP from start_metrics_server and parsed with prometheus_client's parser."""

from __future__ import annotations

import re
import socket
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from repo_paths import REPO

from specdec.telemetry import ServiceMetrics, model_label, start_metrics_server
from specdec.telemetry.metrics import FAMILY_GROUPS, PREFIX


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def scrape():
    metrics = ServiceMetrics("draft", model_name="tiny")
    server = start_metrics_server(free_port(), metrics.registry, addr="127.0.0.1")

    def samples() -> dict[tuple, float]:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    yield metrics, samples
    server.shutdown()


def labels(**extra: str) -> tuple:
    return tuple(sorted({"service": "draft", "model_name": "tiny", **extra}.items()))


def test_port_zero_starts_nothing():
    assert start_metrics_server(0, ServiceMetrics("x").registry) is None


def test_scraped_names_and_values(scrape):
    metrics, samples = scrape
    metrics.observe_request("OK", ttft_s=0.05, tpot_s=0.004, e2e_s=1.2)
    metrics.observe_request("OK", ttft_s=0.5, tpot_s=None, e2e_s=0.6)
    metrics.observe_request("RESOURCE_EXHAUSTED")
    metrics.set_running(3)
    metrics.set_waiting(1)
    metrics.set_kv(used=120, free=904, unreserved=310)
    metrics.observe_batch(3)
    metrics.observe_spec_step(num_drafts=3, num_draft_tokens=24, accepted_per_pos=[3, 2, 0])
    metrics.observe_spec_step(num_drafts=2, num_draft_tokens=16, accepted_per_pos=[1, 1, 1, 1])
    metrics.count_tokens(12, 30)
    metrics.count_tokens(8, 0)  # ended before its first token
    got = samples()

    def value(name: str, **extra: str) -> float:
        return got[(name, labels(**extra))]

    assert value("specdec:requests_total", status="OK") == 2
    assert value("specdec:requests_total", status="RESOURCE_EXHAUSTED") == 1
    assert value("specdec:request_errors_total", code="RESOURCE_EXHAUSTED") == 1
    assert ("specdec:request_errors_total", labels(code="OK")) not in got
    assert value("specdec:time_to_first_token_seconds_count") == 2
    assert value("specdec:time_to_first_token_seconds_sum") == pytest.approx(0.55)
    assert value("specdec:time_to_first_token_seconds_bucket", le="0.06") == 1
    assert value("specdec:time_per_output_token_seconds_count") == 1
    assert value("specdec:e2e_request_latency_seconds_bucket", le="+Inf") == 2
    assert value("specdec:num_requests_running") == 3
    assert value("specdec:num_requests_waiting") == 1
    assert (value("specdec:kv_pages_used"), value("specdec:kv_pages_free")) == (120, 904)
    assert value("specdec:kv_pages_unreserved") == 310  # what admission can still give (reservations count)
    assert value("specdec:batch_size_bucket", le="4.0") == 1
    assert value("specdec:spec_decode_num_drafts_total") == 5
    assert value("specdec:spec_decode_num_draft_tokens_total") == 40
    assert value("specdec:spec_decode_num_accepted_tokens_total") == 9
    per_pos = [
        value("specdec:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(4)
    ]
    assert per_pos == [4, 3, 1, 1]
    assert value("specdec:prompt_tokens_total") == 20 and value("specdec:generation_tokens_total") == 30


def test_status_codes_are_accepted_as_enums(scrape):
    grpc = pytest.importorskip("grpc")
    metrics, samples = scrape
    metrics.observe_request(grpc.StatusCode.CANCELLED, ttft_s=0.1)
    got = samples()
    assert got[("specdec:requests_total", labels(status="CANCELLED"))] == 1
    assert got[("specdec:request_errors_total", labels(code="CANCELLED"))] == 1


def test_draft_counts_only_requests_that_had_a_draft():
    """Under `--speculation auto` a step may verify nothing (plain) or part of the tree: draft counters follow
    what was verified, not the configured tree size."""
    from types import SimpleNamespace

    from draft_service.app import _observe
    from specdec.engine.scheduler import Event

    class Recording:
        def __init__(self):
            self.batches, self.steps = [], []

        def observe_batch(self, n):
            self.batches.append(n)

        def observe_spec_step(self, num_drafts, num_draft_tokens, per_pos):
            self.steps.append((num_drafts, num_draft_tokens, per_pos))

    engine = SimpleNamespace(spec=SimpleNamespace(num_steps=4, num_draft_tokens=8))
    m = Recording()
    plain = [Event(r, [7], from_verify=True) for r in "ab"]
    _observe(m, engine, plain)
    assert m.batches == [2] and m.steps == []
    partial = [Event("a", [1, 2, 3], num_accepted_drafts=2, from_verify=True, num_draft_tokens=4),
               Event("b", [4], from_verify=True, num_draft_tokens=4), Event("c", [], "abort")]
    _observe(m, engine, partial)
    assert m.batches == [2, 2] and m.steps == [(2, 8, [1, 1, 0, 0])]


def test_auto_policy_rates_are_read_when_scraped(scrape):
    """`--speculation auto`'s measured rates and catch-up charge, current at each scrape."""
    from specdec.engine.adaptive import FULL, SpeculationPolicy

    metrics, samples = scrape
    policy = SpeculationPolicy(min_samples=1)
    metrics.track_policy(policy)
    assert not [k for k in samples() if k[0].startswith("specdec:speculation_policy")]  # nothing measured yet
    policy.record(8, 0, tokens=8, seconds=1.0)
    policy.record(8, 0, tokens=16, seconds=1.0)  # the first sample only warms up
    policy.record(8, FULL, tokens=4, seconds=1.0)
    policy.record(8, FULL, tokens=40, seconds=1.0)
    got = samples()
    rate = "specdec:speculation_policy_tokens_per_second"
    assert got[(rate, labels(batch_bucket="8", budget="plain"))] == 16.0
    assert got[(rate, labels(batch_bucket="8", budget="full"))] == 40.0
    policy.record(8, 0, tokens=64, seconds=1.0, steps=16)  # a plain call of 16 steps
    steps = "specdec:speculation_policy_target_steps_total"
    got = samples()
    assert got[(steps, labels(budget="plain"))] == 18.0 and got[(steps, labels(budget="full"))] == 2.0


def exported(metrics: ServiceMetrics) -> dict[str, set[tuple[str, str]]]:
    """{family name: the (service, model_name) labels of its samples} of one exposition of the registry
    (counters by their name without `_total`, as the parser names them; `*_created` timestamps left out)."""
    text = generate_latest(metrics.registry).decode()
    return {family.name: {(sample.labels["service"], sample.labels["model_name"]) for sample in family.samples}
            for family in text_string_to_metric_families(text) if not family.name.endswith("_created")}


def names_of(*groups: str) -> set[str]:
    return {PREFIX + name for group in groups for name in FAMILY_GROUPS[group]}


def test_gateway_exports_only_what_it_sets():
    """No KV, batch-size, speculation, phase or waiting families: a `kv_pages_free == 0` alert would fire on it."""
    from gateway.interceptors import MetricsInterceptor

    metrics = ServiceMetrics("gateway", model_name="target", families=MetricsInterceptor.FAMILIES)
    metrics.set_running(2)
    metrics.observe_request("OK", ttft_s=0.1, tpot_s=0.01, e2e_s=0.5)
    families = exported(metrics)
    assert set(families) == names_of("requests", "running", "fallbacks")
    unset = ("kv_pages", "batch_size", "spec_decode", "speculation", "step_phase", "num_requests_waiting")
    assert not [name for name in families if name.removeprefix(PREFIX).startswith(unset)]
    assert set().union(*families.values()) == {("gateway", "target")}
    for use in (lambda: metrics.set_kv(used=0, free=0), lambda: metrics.observe_batch(1),
                lambda: metrics.observe_spec_step(1, 4, [1]), lambda: metrics.track(kv_pages=lambda: (0, 1)),
                lambda: metrics.track_policy(None), lambda: metrics.observe_phase("step", 0.1),
                lambda: metrics.set_waiting(1)):
        with pytest.raises(LookupError, match="family group"):  # a family it did not register: a bug, said so
            use()


def test_target_exports_what_it_sets():
    """Gauges, verify batch sizes and step phases; no request latencies or speculation counters (the draft's)."""
    from target_service.app import METRIC_FAMILIES

    metrics = ServiceMetrics("target", model_name="llama3-8b", families=METRIC_FAMILIES)
    metrics.track(kv_pages=lambda: (3, 61), running=lambda: 1, waiting=lambda: 0, engine_busy=lambda: 0.0)
    metrics.observe_batch(2)
    metrics.observe_phase("forward", 0.01)
    families = exported(metrics)
    assert set(families) == names_of("running", "waiting", "kv", "batch", "phases", "engine")
    assert all(labels == {("target", "llama3-8b")} for labels in families.values())
    with pytest.raises(LookupError):
        metrics.observe_request("OK")


def test_draft_exports_every_family():
    metrics = ServiceMetrics("draft", model_name="draft")  # default: all groups
    metrics.observe_request("OK")
    metrics.observe_spec_step(num_drafts=1, num_draft_tokens=4, accepted_per_pos=[1])
    metrics.observe_phase("step", 0.01)
    policy = {PREFIX + "speculation_policy_tokens_per_second", PREFIX + "speculation_policy_target_steps"}
    assert set(exported(metrics)) == names_of(*FAMILY_GROUPS) - policy  # policy: a collector, --speculation auto


def test_observability_doc_lists_each_services_groups():
    """Both places docs/observability.md names the gateway's groups, and its "Groups registered" line, say what
    the code registers (one place said `requests`, `running` while the gateway also sets `fallbacks`)."""
    from gateway.interceptors import MetricsInterceptor
    from specdec.telemetry.metrics import MODEL_FAMILIES
    from target_service.app import METRIC_FAMILIES

    doc = " ".join((REPO / "docs" / "observability.md").read_text().split())
    line = doc[doc.index("Groups registered:") :].split("Example selectors")[0]
    gateway, draft, target = (set(re.findall(r"`(\w+)`", part)) for part in re.findall(r"FAMILIES` \(([^)]*)\)", line))
    assert (gateway, target) == (set(MetricsInterceptor.FAMILIES), set(METRIC_FAMILIES))
    assert "all but" in line and draft == set(FAMILY_GROUPS) - MODEL_FAMILIES  # the draft's: all but these
    assert "`specdec:pair_part_up`" in line
    assert "it registers `requests`, `running` and `fallbacks`, plus its own `pair_part_up`" in doc


def test_unknown_family_group_is_refused():
    with pytest.raises(ValueError, match="kvcache"):
        ServiceMetrics("x", families={"kvcache"})


def test_model_label_is_the_checkpoint_directory_or_the_preset_name():
    assert model_label("models/tiny-code/target") == "target"
    assert model_label("/ckpt/Meta-Llama-3-8B-Instruct/") == "Meta-Llama-3-8B-Instruct"
    assert model_label("llama3-8b-eagle3") == "llama3-8b-eagle3"  # --load-format dummy --config NAME


def test_metrics_listen_on_the_services_host_and_a_busy_port_is_a_clear_error():
    """The endpoint binds where the service does (`--host 127.0.0.1` kept it on 0.0.0.0 before), and a port that is
    taken is a ConfigError (the CLI's `error: ...`, exit 2) instead of an OSError traceback."""
    from specdec.errors import ConfigError

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = start_metrics_server(port, ServiceMetrics("target").registry, "127.0.0.1")
    try:
        assert server.server_address[0] == "127.0.0.1"
        with pytest.raises(ConfigError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            start_metrics_server(port, ServiceMetrics("target").registry, "127.0.0.1")
    finally:
        server.shutdown()
        server.server_close()


def test_a_metrics_port_that_is_the_services_own_port_is_named_as_such():
    """`--metrics-port` equal to `--port` is refused before either binds, naming both flags (it used to say that
    another process listened there)."""
    from specdec.errors import ConfigError

    with pytest.raises(ConfigError, match="--metrics-port 50099 is also this service's --port"):
        start_metrics_server(50099, ServiceMetrics("target").registry, "127.0.0.1", grpc_port=50099)


PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
                       "text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


@pytest.mark.parametrize("accept", [PROMETHEUS_2_ACCEPT,
                                    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8", None])
def test_every_scraper_gets_the_text_format_with_the_documented_names(accept):
    """Prometheus 2.x asks for OpenMetrics first; prometheus_client's answer renamed every sample `specdec:x` ->
    `specdec_x` but kept `specdec:x` in its HELP and TYPE lines (a strict parser refused it: "Clashing name"; QA).
    The endpoint now answers every scraper in the text format, whose names are the documented ones; gzip still
    works."""
    import gzip

    metrics = ServiceMetrics("gateway", model_name="tiny", families={"requests", "fallbacks"})
    metrics.observe_request("OK", ttft_s=0.05, tpot_s=0.004, e2e_s=1.2)
    server = start_metrics_server(free_port(), metrics.registry, addr="127.0.0.1")
    try:
        for encoding in (None, "gzip"):
            request = urllib.request.Request(f"http://127.0.0.1:{server.server_port}/metrics")
            if accept:
                request.add_header("Accept", accept)
            if encoding:
                request.add_header("Accept-Encoding", encoding)
            with urllib.request.urlopen(request, timeout=5) as response:
                kind, body = response.headers["Content-Type"], response.read()
                if encoding:
                    assert response.headers["Content-Encoding"] == "gzip"
                    body = gzip.decompress(body)
            assert kind.startswith("text/plain") and "version=0.0.4" in kind, kind
            text = body.decode()
            names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
            assert "specdec:requests_total" in names and all(n.startswith("specdec:") for n in names), names
            assert "specdec_" not in text
    finally:
        server.shutdown()
