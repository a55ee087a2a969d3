"""A minimal OTLP/gRPC trace receiver on loopback for the benchmarks (a stand-in for a collector): counts the spans
it gets and, when asked, keeps them (name, kind, ids, start and end on the host clock, attributes).

    receiver = OtlpReceiver(keep=True)   # OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:{receiver.port}
    ...
    receiver.stop(); receiver.spans, receiver.num_spans
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class Span:
    name: str
    kind: int  # OTLP's SpanKind number (2 SERVER, 3 CLIENT)
    span_id: bytes
    parent_id: bytes
    start: int  # ns, host clock
    end: int
    attributes: dict = field(default_factory=dict)  # its int, float, string and bool attributes


def _attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        if kind in ("int_value", "double_value", "string_value", "bool_value"):
            out[kv.key] = getattr(kv.value, kind)
    return out


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self.num_spans = 0
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def Export(self, request, context):  # noqa: N802 (the proto's name)
        got = [s for r in request.resource_spans for scope in r.scope_spans for s in scope.spans]
        kept = [Span(s.name, s.kind, s.span_id, s.parent_span_id, s.start_time_unix_nano, s.end_time_unix_nano,
                     _attributes(s)) for s in got] if self.keep else []
        with self._lock:
            self.num_spans += len(got)
            self.spans += kept
        return trace_service_pb2.ExportTraceServiceResponse()

    def stop(self) -> None:
        self._server.stop(grace=None)
