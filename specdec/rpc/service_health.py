"""What a model service reports once it serves, from two sources that change on their own.

- SERVING under every name while all is well.
- NOT_SERVING under the service's own name and the overall "" while its backend is away (a draft's remote target:
  `set_backend`, from `TargetWatch`). The process's `liveness` name stays SERVING: a restart would not bring the
  backend back.
- UNKNOWN under every name, liveness included, while its engine is stalled (`set_stalled`, from `StallWatch`),
  and every call but health and reflection refused UNAVAILABLE with the reason. A Kubernetes liveness probe then
  restarts a process whose engine stays stuck; the gateway reads UNKNOWN as a part that stopped answering and
  moves its streams on (`gateway.downstream.Health.STALLED`).

A stall outranks a backend away, and the end of one restores what the other still says.
"""

from __future__ import annotations

from grpc_health.v1 import health_pb2

from specdec.rpc.readiness import ReadinessGate
from specdec.rpc.server import ServerHandle

_STATUS = health_pb2.HealthCheckResponse


class ServiceHealth:
    def __init__(self, handle: ServerHandle, gate: ReadinessGate, own_names: tuple[str, ...]) -> None:
        """`own_names`: the names a backend away sets NOT_SERVING (the service's own and the overall "")."""
        self.handle, self.gate, self.own_names = handle, gate, own_names
        self.backend_up = True
        self.stalled: str | None = None  # why the engine counts as stalled (None: it moves)

    async def set_backend(self, up: bool) -> None:
        self.backend_up = up
        await self._apply()

    async def set_stalled(self, reason: str | None) -> None:
        self.stalled = reason
        await self._apply()

    async def _apply(self) -> None:
        if self.stalled is not None:
            self.gate.close(self.stalled)
            await self.handle.set_status(_STATUS.UNKNOWN)
            return
        self.gate.open()
        others = [name for name in self.handle.all_names if name not in self.own_names]
        await self.handle.set_status(_STATUS.SERVING, others)
        await self.handle.set_serving(self.backend_up, self.own_names)
