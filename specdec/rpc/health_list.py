"""`grpc.health.v1.Health/List` for the aio health servicer.

The health proto grpcio-health-checking ships has three methods, Check, Watch and List, and reflection describes
all three; its servicer implements the first two only. A client calling List (`grpcurl ... grpc.health.v1.Health/
List`) got UNIMPLEMENTED "Method not implemented!" and the server logged a NotImplementedError traceback (QA).
List answers every name health knows, each with what Check would say for it.
"""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2


class HealthServicer(health.aio.HealthServicer):
    async def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:  # noqa: N802
        # `_server_status`: the statuses `set` and `enter_graceful_shutdown` keep and Check reads
        statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()})
