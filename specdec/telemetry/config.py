"""Telemetry settings, read from the environment in one place.

Standard OpenTelemetry variables decide whether tracing is on and how it samples; `SPECDEC_STEP_SPAN_RATIO`
decides how many speculative steps get their own spans. Everything else (OTLP headers, timeouts, compression,
`OTEL_RESOURCE_ATTRIBUTES`, batch processor sizes) the OpenTelemetry SDK reads itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class TelemetryConfig:
    traces_endpoint: str | None = (
        None  # OTLP/gRPC collector, e.g. "http://127.0.0.1:4317"; None = tracing off
    )
    service_name: str | None = None  # OTEL_SERVICE_NAME; None = the service's own default
    sdk_disabled: bool = False  # OTEL_SDK_DISABLED=true turns tracing off even with an endpoint
    traces_sampler: str = "parentbased_always_on"  # OTEL_TRACES_SAMPLER
    traces_sampler_arg: float = 1.0  # OTEL_TRACES_SAMPLER_ARG (ratio for the *traceidratio samplers)
    step_span_ratio: float = 0.0  # SPECDEC_STEP_SPAN_RATIO: fraction of speculative steps with spans

    @property
    def tracing_enabled(self) -> bool:
        return bool(self.traces_endpoint) and not self.sdk_disabled

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TelemetryConfig:
        env = os.environ if environ is None else environ
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        endpoint = endpoint or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        return cls(
            traces_endpoint=endpoint or None,
            service_name=env.get("OTEL_SERVICE_NAME", "").strip() or None,
            sdk_disabled=env.get("OTEL_SDK_DISABLED", "").strip().lower() in _TRUE,
            traces_sampler=env.get("OTEL_TRACES_SAMPLER", "").strip().lower() or cls.traces_sampler,
            traces_sampler_arg=_ratio(env, "OTEL_TRACES_SAMPLER_ARG", cls.traces_sampler_arg),
            step_span_ratio=_ratio(env, "SPECDEC_STEP_SPAN_RATIO", cls.step_span_ratio),
        )


def _ratio(env: Mapping[str, str], name: str, default: float) -> float:
    """A float in [0, 1] from `env[name]`; a bad value logs a warning and gives `default`."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        logger.warning("%s=%r is not a number; using %s", name, raw, default)
        return default
    if not 0.0 <= value <= 1.0:
        logger.warning("%s=%s is outside [0, 1]; clamping", name, value)
    return min(max(value, 0.0), 1.0)
