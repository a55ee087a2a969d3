"""The real target, draft and gateway as processes (the tiny pair on CPU), tracing to an OTLP/gRPC receiver inside
the test, metrics on `--metrics-port`, logs as JSON lines: one request is one trace with every parent link right,
the scraped metrics are plausible, and every log line of the request carries its request id in all three
services."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from otlp_receiver import TraceReceiver
from prometheus_client.parser import text_string_to_metric_families

from gateway.client import GatewayClient
from gateway.interceptors import MetricsInterceptor
from gateway.local_stack import HEALTH_NAMES, REPO_ROOT, StackConfig, _free_ports, _is_serving
from specdec.telemetry.metrics import FAMILY_GROUPS, MODEL_FAMILIES, PREFIX
from target_service.app import METRIC_FAMILIES as TARGET_FAMILIES

REQUEST_ID = "req-telemetry-e2e"
NEW_TOKENS = 12
PROMPT = "def fibonacci(n):"
SERVICES = ("target", "draft", "gateway")
SERVICE_NAMES = {"target": "target_service", "draft": "draft_service", "gateway": "gateway"}


def _start(config: StackConfig, metrics_ports: dict[str, int], env: dict[str, str], log_dir: Path) -> dict:
    commands = config.commands()
    procs = {}
    for name in SERVICES:
        argv = [*commands[name], "--metrics-port", str(metrics_ports[name]), "--log-format", "json"]
        with open(log_dir / f"{name}.log", "wb") as log:
            procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    return procs


def _wait_serving(config: StackConfig, procs: dict, log_dir: Path, timeout_s: float = 120.0) -> None:
    deadline, waiting = time.monotonic() + timeout_s, list(SERVICES)
    while waiting:
        for name in list(waiting):
            if procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited: {(log_dir / f'{name}.log').read_text()[-3000:]}")
            if _is_serving(config.addr(name), HEALTH_NAMES[name]):
                waiting.remove(name)
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"not serving after {timeout_s} s: {waiting}")
        time.sleep(0.2)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One request through the three services; returns spans, scraped metrics, log lines and the stats."""
    log_dir = tmp_path_factory.mktemp("telemetry-e2e")
    config = StackConfig.free_ports(speculation="always")
    metrics_ports = dict(zip(SERVICES, _free_ports(3), strict=True))
    with TraceReceiver() as receiver:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50",
               "SPECDEC_STEP_SPAN_RATIO": "1.0", "PYTHONPATH": str(REPO_ROOT)}
        for var in ("OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"):
            env.pop(var, None)
        procs = _start(config, metrics_ports, env, log_dir)
        try:
            _wait_serving(config, procs, log_dir)
            with GatewayClient(config.addr("gateway"), timeout_s=60) as client:
                text, stats = client.complete(PROMPT, max_new_tokens=NEW_TOKENS, request_id=REQUEST_ID)
            metrics = {name: _scrape(port) for name, port in metrics_ports.items()}
        finally:
            for name in SERVICES[::-1]:  # gateway first; each flushes its spans on exit
                procs[name].send_signal(signal.SIGTERM)
                try:
                    procs[name].wait(30)
                except subprocess.TimeoutExpired:
                    procs[name].kill()
                    procs[name].wait()
        spans = receiver.spans()
    logs = {name: [json.loads(line) for line in (log_dir / f"{name}.log").read_text().splitlines()
                   if line.startswith("{")] for name in SERVICES}
    return {"spans": spans, "metrics": metrics, "logs": logs, "stats": stats, "text": text}


def test_telemetry_e2e_one_trace_with_parent_links(run):
    spans = [s for s in run["spans"] if s.attributes.get("specdec.request_id") == REQUEST_ID
             or s.name.startswith(("draft.", "target.", "gateway.", "specdec.v1."))]
    assert {s.service for s in spans} == set(SERVICE_NAMES.values())
    (trace_id,) = {s.trace_id for s in spans}
    by_id = {s.span_id: s for s in spans}

    def named(name: str, kind: str, service: str) -> list:
        found = [s for s in spans if (s.name, s.kind, s.service) == (name, kind, service)]
        assert found, f"no {kind} span {name} from {service}"
        return found

    (gw_server,) = named("specdec.v1.GatewayService/Generate", "SERVER", "gateway")
    assert gw_server.parent_span_id == "" and gw_server.attributes["specdec.request_id"] == REQUEST_ID
    for name in ("gateway.tokenize", "gateway.route"):
        (span,) = named(name, "INTERNAL", "gateway")
        assert span.parent_span_id == gw_server.span_id
    (gw_client,) = named("specdec.v1.DraftService/Generate", "CLIENT", "gateway")
    assert gw_client.parent_span_id == gw_server.span_id
    (draft_server,) = named("specdec.v1.DraftService/Generate", "SERVER", "draft_service")
    assert draft_server.parent_span_id == gw_client.span_id
    assert draft_server.attributes["rpc.grpc.status_code"] == 0

    # the prefill: draft CLIENT span under the request's span, the target's SERVER span under it
    (prefill_client,) = named("specdec.v1.TargetService/Prefill", "CLIENT", "draft_service")
    (prefill_server,) = named("specdec.v1.TargetService/Prefill", "SERVER", "target_service")
    assert prefill_client.parent_span_id == draft_server.span_id
    assert prefill_server.parent_span_id == prefill_client.span_id
    assert prefill_server.attributes["num_prompt_tokens"] == run["stats"].prompt_tokens

    # every speculative step: propose, verify, extend under the request; the Verify RPC under draft.verify
    steps = {name: named(name, "INTERNAL", "draft_service") for name in ("draft.propose", "draft.verify")}
    num_steps = len(steps["draft.verify"])
    assert num_steps == len(steps["draft.propose"]) >= 1
    for span in (*steps["draft.propose"], *steps["draft.verify"]):
        assert span.parent_span_id == draft_server.span_id
        assert span.attributes["batch_size"] == 1
        assert span.attributes["num_draft_tokens"] > 0
    assert sum(s.attributes["accepted"] for s in steps["draft.verify"]) >= 1
    verify_clients = named("specdec.v1.TargetService/Verify", "CLIENT", "draft_service")
    verify_servers = named("specdec.v1.TargetService/Verify", "SERVER", "target_service")
    batches = named("target.verify_batch", "INTERNAL", "target_service")
    assert len(verify_clients) == len(verify_servers) == len(batches) == num_steps
    verify_step_ids = {s.span_id for s in steps["draft.verify"]}
    assert {c.parent_span_id for c in verify_clients} == verify_step_ids
    assert {s.parent_span_id for s in verify_servers} == {c.span_id for c in verify_clients}
    assert {b.parent_span_id for b in batches} == {s.span_id for s in verify_servers}
    for b in batches:  # a speculative step: one token per call past the tree, every accepted row's features
        assert (b.attributes["plain_steps"], b.attributes["feature_rows"], b.attributes["num_rpcs"]) == (1, 0, 1)
    extends = named("draft.extend", "INTERNAL", "draft_service")
    assert all(s.parent_span_id == draft_server.span_id for s in extends)

    # no orphans: every parent is in the trace; health checks and model-info polls made no traces
    assert all(s.parent_span_id in by_id for s in spans if s.parent_span_id)
    assert all(s.trace_id == trace_id for s in run["spans"]), {s.name for s in run["spans"] if s.trace_id != trace_id}


def _samples(text: str, name: str) -> dict[str, float]:
    """{labels text: value} of every sample of `name` in an exposition."""
    found = {}
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        found[match.group(1) or ""] = float(match.group(2))
    return found


def _value(text: str, name: str) -> float:
    return sum(_samples(text, name).values())


def test_telemetry_e2e_metrics(run):
    stats, metrics = run["stats"], run["metrics"]
    draft, target, gateway = metrics["draft"], metrics["target"], metrics["gateway"]
    for text in (draft, target):  # KV gauges: all pages back in the pool after the request
        used, free = _value(text, "specdec:kv_pages_used"), _value(text, "specdec:kv_pages_free")
        assert used == 0 and free > 0 and _value(text, "specdec:kv_pages_unreserved") == free  # none reserved
        assert _value(text, "specdec:num_requests_running") == 0
    drafts = _value(draft, "specdec:spec_decode_num_drafts_total")
    draft_tokens = _value(draft, "specdec:spec_decode_num_draft_tokens_total")
    accepted = _value(draft, "specdec:spec_decode_num_accepted_tokens_total")
    assert drafts >= 1 and 1 <= accepted <= draft_tokens
    per_pos = _samples(draft, "specdec:spec_decode_num_accepted_tokens_per_pos_total")
    by_pos = sorted((int(re.search(r'position="(\d+)"', k).group(1)), v) for k, v in per_pos.items())
    counts = [v for _, v in by_pos]
    assert [p for p, _ in by_pos] == list(range(len(by_pos)))
    assert counts == sorted(counts, reverse=True) and sum(counts) == accepted and counts[0] <= drafts
    while counts and counts[-1] == 0:
        counts.pop()
    assert [int(c) for c in counts] == list(stats.accepted_per_position)  # one request: its own stats
    # the prefill's token + (accepted + bonus) per step, less what max_new_tokens cut from the last step
    assert stats.completion_tokens <= 1 + drafts + accepted
    assert _value(draft, 'specdec:requests_total') == 1
    assert _value(gateway, "specdec:requests_total") == 1
    assert _value(gateway, "specdec:time_to_first_token_seconds_count") == 1
    assert _value(gateway, "specdec:e2e_request_latency_seconds_count") == 1
    assert _value(target, "specdec:batch_size_count") == drafts  # one verify batch per step
    for text in (draft, gateway):  # token counters: the one request's prompt and what it generated
        assert _value(text, "specdec:prompt_tokens_total") == stats.prompt_tokens
        assert _value(text, "specdec:generation_tokens_total") == stats.completion_tokens


def _families(text: str) -> dict[str, set[tuple[str, str]]]:
    """{family name: its samples' (service, model_name) labels} of a scrape, `*_created` timestamps left out."""
    return {family.name: {(sample.labels["service"], sample.labels["model_name"]) for sample in family.samples}
            for family in text_string_to_metric_families(text) if not family.name.endswith("_created")}


def _names(groups) -> set[str]:
    return {PREFIX + name for group in groups for name in FAMILY_GROUPS[group]}


def test_telemetry_e2e_each_service_exports_what_it_sets(run):
    """The gateway has no KV, batch-size, speculation or phase families (a `kv_pages_free == 0` alert would fire on
    it), the target no request or speculation ones; `service` is the short name, `model_name` the model's."""
    families = {name: _families(text) for name, text in run["metrics"].items()}
    policy = {PREFIX + "speculation_policy_tokens_per_second", PREFIX + "speculation_policy_target_steps"}
    # and the gateway's own `pair_part_up` (`gateway/pair_metrics.py`, not a family group)
    assert set(families["gateway"]) == _names(MetricsInterceptor.FAMILIES) | {PREFIX + "pair_part_up"}
    assert set(families["target"]) == _names(TARGET_FAMILIES)
    assert set(families["draft"]) == _names(MODEL_FAMILIES) - policy  # --speculation always: no policy collector
    for name, model in (("gateway", "target"), ("target", "target")):  # models/tiny-code/target
        assert set().union(*families[name].values()) == {(name, model)}, name
    assert {service for labels in families["draft"].values() for service, _ in labels} == {"draft"}


def test_telemetry_e2e_draft_model_name(run):
    assert set().union(*_families(run["metrics"]["draft"]).values()) == {("draft", "draft")}  # models/tiny-code/draft


def _phase(text: str, phase: str, part: str) -> float:
    """`specdec:step_phase_seconds_<part>` (sum or count) of one phase."""
    return sum(v for k, v in _samples(text, f"specdec:step_phase_seconds_{part}").items() if f'phase="{phase}"' in k)


def test_telemetry_e2e_step_phases(run):
    """Where the steps went: every verify step timed on both sides, the draft's round trip covering the target's
    forward, the phases of a step inside the step."""
    draft, target = run["metrics"]["draft"], run["metrics"]["target"]
    drafts = _value(draft, "specdec:spec_decode_num_drafts_total")
    assert drafts >= 1
    for phase in ("propose", "verify", "step"):  # one request, always speculating: one of each per step
        assert _phase(draft, phase, "count") == drafts, phase
    assert _phase(draft, "admit", "count") >= 1
    for phase in ("queue", "forward", "reply"):  # one Verify RPC per step
        assert _phase(target, phase, "count") == drafts, phase
    assert _phase(draft, "verify", "sum") > _phase(target, "forward", "sum") + _phase(target, "queue", "sum")
    inside = sum(_phase(draft, p, "sum") for p in ("propose", "verify", "extend"))
    assert 0 < inside <= _phase(draft, "step", "sum")


def test_telemetry_e2e_final_message_has_acceptance(run):
    stats = run["stats"]
    assert stats.speculative and stats.request_id == REQUEST_ID
    assert stats.tau > 1.0 and stats.accepted_per_position
    assert stats.completion_tokens <= NEW_TOKENS


def test_telemetry_e2e_json_logs_carry_request_id(run):
    """Each service logs the request (its one INFO line at least); every line from its first line about the
    request to its last carries the request id and the request's trace id; no line names the id without it."""
    (trace_id,) = {s.trace_id for s in run["spans"]}
    for name, lines in run["logs"].items():
        mine = [i for i, line in enumerate(lines) if line["request_id"] == REQUEST_ID]
        assert mine, f"{name} logged nothing with the request id"
        during = lines[mine[0]: mine[-1] + 1]
        assert all(line["request_id"] == REQUEST_ID for line in during), (name, during)
        assert all(line.get("trace_id") == trace_id for line in during), (name, during)
        assert all(line["request_id"] == REQUEST_ID for line in lines if REQUEST_ID in json.dumps(line)), name
    (gateway_line,) = [line for line in run["logs"]["gateway"] if line.get("rpc_method", "").endswith("/Generate")]
    assert gateway_line["completion_tokens"] == run["stats"].completion_tokens
    assert gateway_line["tau"] == pytest.approx(run["stats"].tau, abs=1e-3)
    (draft_line,) = [line for line in run["logs"]["draft"] if line["msg"].startswith("done:")]
    assert draft_line["completion_tokens"] == run["stats"].completion_tokens and "ttft_s" in draft_line
