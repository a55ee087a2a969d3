"""The aio health servicer with `grpc.health.v1.Health/List`, and a Check of an unknown name that says why.

The health proto grpcio-health-checking ships has three methods, Check, Watch and List, and reflection describes
all three; its servicer implements the first two only. A client calling List (`grpcurl ... grpc.health.v1.Health/
List`) got UNIMPLEMENTED "Method not implemented!" and the server logged a NotImplementedError traceback (QA).
List answers every name health knows, each with what Check would say for it. Check of a name health does not know
is NOT_FOUND, as the stock servicer answers, but with a message naming the ones it knows (the stock one's was
empty: QA).
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2


class HealthServicer(health.aio.HealthServicer):
    async def Check(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:  # noqa: N802
        status = self._server_status.get(request.service)
        if status is None:
            known = ", ".join(repr(name) for name in sorted(self._server_status))
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no service {request.service!r} here; health knows {known} ('': the server)")
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:  # noqa: N802
        # `_server_status`: the statuses `set` and `enter_graceful_shutdown` keep and Check reads
        statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()})
