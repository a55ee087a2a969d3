"""A real OTLP/gRPC trace receiver on loopback, for tests: collects every exported span."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: str  # "SERVER", "CLIENT", "INTERNAL", ...
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    attributes: dict
    status_code: int  # 0 unset, 1 ok, 2 error


class TraceReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def __enter__(self) -> TraceReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def Export(self, request, context):  # noqa: N802 (the proto's name)
        received = [
            ReceivedSpan(
                service=_service_name(resource_spans.resource),
                name=span.name,
                kind=span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_"),
                trace_id=span.trace_id.hex(),
                span_id=span.span_id.hex(),
                parent_span_id=span.parent_span_id.hex(),
                attributes={kv.key: _value(kv.value) for kv in span.attributes},
                status_code=span.status.code,
            )
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]
        with self._lock:
            self._spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


def _service_name(resource) -> str:
    names = [_value(kv.value) for kv in resource.attributes if kv.key == "service.name"]
    return names[0] if names else ""


def _value(any_value):
    field = any_value.WhichOneof("value")
    return getattr(any_value, field) if field else None
