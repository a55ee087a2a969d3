"""Observability for the services: traces (OpenTelemetry, OTLP), metrics (Prometheus), logs (text or JSON).

Nothing here depends on the services. The gRPC pieces (trace context in metadata) live in
`specdec.telemetry.grpc_tracing`, which is the only module that imports grpc; engines can import the rest.
See docs/observability.md.
"""

from specdec.telemetry.args import add_telemetry_args
from specdec.telemetry.config import TelemetryConfig
from specdec.telemetry.logs import bind_request_id, request_id_var, setup_logging
from specdec.telemetry.metrics import ALL_FAMILIES, MODEL_FAMILIES, ServiceMetrics, model_label, start_metrics_server
from specdec.telemetry.tracing import StepSpanSampler, get_tracer, setup_tracing, shutdown_tracing

__all__ = [
    "ALL_FAMILIES",
    "MODEL_FAMILIES",
    "ServiceMetrics",
    "StepSpanSampler",
    "TelemetryConfig",
    "add_telemetry_args",
    "bind_request_id",
    "get_tracer",
    "model_label",
    "request_id_var",
    "setup_logging",
    "setup_tracing",
    "shutdown_tracing",
    "start_metrics_server",
]
