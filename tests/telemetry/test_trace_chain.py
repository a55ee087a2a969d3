"""Three services in three processes, gateway -> draft -> target, exporting to a real OTLP receiver:
one trace, every span's parent right, across process boundaries (W3C traceparent in gRPC metadata)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

# Helpers next to this file (pytest puts this directory on sys.path).
from chain_service import GATEWAY_GENERATE, NUM_STEPS
from otlp_receiver import TraceReceiver

REPO = Path(__file__).resolve().parents[2]
CHAIN_SERVICE = Path(__file__).with_name("chain_service.py")


def start_hop(role: str, name_default: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(CHAIN_SERVICE), role, name_default],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def generate(gateway: str, route: list[str]) -> list[dict]:
    async with grpc.aio.insecure_channel(gateway) as channel:
        request = json.dumps({"request_id": "req-7", "route": route}).encode()
        call = channel.unary_stream(GATEWAY_GENERATE)(request)
        return [json.loads(response) async for response in call]


@pytest.fixture(scope="module")
def chain_spans():
    """Run one request through the chain; return (spans by name, the services' JSON log lines)."""
    with TraceReceiver() as receiver:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "SPECDEC_STEP_SPAN_RATIO": "1.0",
        }
        env.pop("OTEL_SDK_DISABLED", None)
        hops = [
            start_hop("gateway", "gateway", env),
            start_hop("draft", "draft_service", env),
            start_hop("target", "target", {**env, "OTEL_SERVICE_NAME": "target_service"}),
        ]
        try:
            ports = [hop.stdout.readline().strip() for hop in hops]
            assert all(ports), [hop.stderr.read() for hop in hops if hop.poll() is not None]
            addresses = [f"127.0.0.1:{port}" for port in ports]
            responses = asyncio.run(generate(addresses[0], addresses[1:]))
            assert responses == [{"token": step, "accepted": 3} for step in range(NUM_STEPS)]
        finally:
            for hop in hops:
                hop.send_signal(signal.SIGTERM)
            logs = [hop.communicate(timeout=20)[1] for hop in hops]  # exit flushes the spans
        assert [hop.returncode for hop in hops] == [0, 0, 0], logs
        spans = receiver.spans()
    by_name: dict[tuple[str, str], list] = {}
    for span in spans:
        by_name.setdefault((span.name, span.kind), []).append(span)
    log_lines = [json.loads(line) for text in logs for line in text.splitlines() if line.startswith("{")]
    return spans, by_name, log_lines


def test_one_trace_across_three_services(chain_spans):
    spans, by_name, _ = chain_spans
    assert {span.service for span in spans} == {"gateway", "draft_service", "target_service"}
    assert len({span.trace_id for span in spans}) == 1

    def one(name: str, kind: str, service: str):
        (span,) = by_name[(name, kind)]
        assert span.service == service
        return span

    gw_server = one("specdec.v1.Gateway/Generate", "SERVER", "gateway")
    gw_client = one("specdec.v1.DraftService/Generate", "CLIENT", "gateway")
    draft_server = one("specdec.v1.DraftService/Generate", "SERVER", "draft_service")
    assert gw_server.parent_span_id == ""
    assert gw_client.parent_span_id == gw_server.span_id
    assert draft_server.parent_span_id == gw_client.span_id
    for span in (gw_server, draft_server):
        assert span.attributes["specdec.request_id"] == "req-7"
        assert span.attributes["rpc.system"] == "grpc"
        assert span.attributes["rpc.grpc.status_code"] == 0

    steps = {name: by_name[(name, "INTERNAL")] for name in ("draft.propose", "draft.verify", "draft.extend")}
    for name, step_spans in steps.items():
        assert len(step_spans) == NUM_STEPS, name
        assert all(s.parent_span_id == draft_server.span_id for s in step_spans), name
        assert all(s.attributes["batch_size"] == 1 for s in step_spans), name
    assert all(s.attributes["accepted"] == 3 for s in steps["draft.verify"])
    assert all(s.attributes["num_draft_tokens"] == 4 for s in steps["draft.verify"])

    verify_clients = by_name[("specdec.v1.TargetService/Verify", "CLIENT")]
    verify_servers = by_name[("specdec.v1.TargetService/Verify", "SERVER")]
    verify_steps = steps["draft.verify"]
    assert sorted(c.parent_span_id for c in verify_clients) == sorted(s.span_id for s in verify_steps)
    assert sorted(s.parent_span_id for s in verify_servers) == sorted(c.span_id for c in verify_clients)
    assert {s.service for s in verify_servers} == {"target_service"}
    assert all(s.attributes["specdec.request_id"] == "req-7" for s in verify_servers)


def test_logs_carry_request_and_trace_ids(chain_spans):
    spans, _, log_lines = chain_spans
    (trace_id,) = {span.trace_id for span in spans}
    handler_lines = [line for line in log_lines if line["logger"] == "chain"]
    assert {line["role"] for line in handler_lines} == {"gateway", "draft", "target"}
    for line in handler_lines:
        assert line["request_id"] == "req-7"
        assert line["trace_id"] == trace_id
