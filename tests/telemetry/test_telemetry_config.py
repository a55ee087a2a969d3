"""TelemetryConfig.from_env and the shared CLI flags."""

from __future__ import annotations

import argparse
import os

import pytest

from specdec.telemetry import TelemetryConfig, add_telemetry_args


def test_defaults_mean_tracing_off_and_no_step_spans():
    config = TelemetryConfig.from_env({})
    assert config == TelemetryConfig()
    assert not config.tracing_enabled and config.step_span_ratio == 0.0


def test_reads_the_standard_variables():
    config = TelemetryConfig.from_env(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
            "OTEL_SERVICE_NAME": "draft-a",
            "OTEL_TRACES_SAMPLER": "ParentBased_TraceIdRatio",
            "OTEL_TRACES_SAMPLER_ARG": "0.25",
            "SPECDEC_STEP_SPAN_RATIO": "0.1",
        }
    )
    assert config.tracing_enabled and config.traces_endpoint == "http://collector:4317"
    assert config.service_name == "draft-a"
    assert (config.traces_sampler, config.traces_sampler_arg) == ("parentbased_traceidratio", 0.25)
    assert config.step_span_ratio == 0.1


def test_traces_endpoint_wins_and_sdk_disabled_turns_tracing_off():
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:4317",
    }
    assert TelemetryConfig.from_env(env).traces_endpoint == "http://b:4317"
    assert not TelemetryConfig.from_env({**env, "OTEL_SDK_DISABLED": "true"}).tracing_enabled


@pytest.mark.parametrize(("raw", "ratio"), [("2", 1.0), ("-1", 0.0), ("lots", 0.0), (" 0.5 ", 0.5)])
def test_bad_ratios_are_clamped_or_ignored(raw, ratio):
    assert TelemetryConfig.from_env({"SPECDEC_STEP_SPAN_RATIO": raw}).step_span_ratio == ratio


def test_telemetry_args():
    parser = add_telemetry_args(argparse.ArgumentParser())
    assert vars(parser.parse_args([])) == {"metrics_port": 0, "log_format": "text", "log_level": "INFO"}
    args = parser.parse_args(["--metrics-port", "9100", "--log-format", "json", "--log-level", "debug"])
    assert (args.metrics_port, args.log_format, args.log_level) == (9100, "json", "DEBUG")
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-format", "xml"])


@pytest.mark.parametrize(("endpoint", "env", "transport"), [
    ("http://127.0.0.1:4317", {}, "plaintext"),
    ("https://collector:4317", {}, "TLS"),
    ("127.0.0.1:4317", {}, "TLS"),  # no scheme: the exporter's TLS, which lost every span to a plaintext collector
    ("localhost:4317", {"OTEL_EXPORTER_OTLP_INSECURE": "true"}, "plaintext"),
    ("http://collector:4317", {"OTEL_EXPORTER_OTLP_TRACES_INSECURE": "false"}, "TLS"),
    ("https://collector:4317", {"OTEL_EXPORTER_OTLP_INSECURE": "true"}, "TLS"),
])
def test_the_transport_named_is_the_exporters(endpoint, env, transport):
    """`otlp_transport` says what the OTLP exporter does with the endpoint (its channel's kind, read back)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    from specdec.telemetry.tracing import otlp_transport

    assert otlp_transport(endpoint, env) == transport
    saved = {k: os.environ.pop(k, None) for k in ("OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_TRACES_INSECURE")}
    try:
        os.environ.update(env)
        exporter = OTLPSpanExporter(endpoint=endpoint)
        assert ("TLS" if not exporter._insecure else "plaintext") == transport
        exporter.shutdown()
    finally:
        for k in env:
            os.environ.pop(k, None)
        os.environ.update({k: v for k, v in saved.items() if v is not None})
