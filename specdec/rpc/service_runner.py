"""The life of a model service process, shared by target_service and draft_service.

Start listening at once (health NOT_SERVING, other RPCs UNAVAILABLE "loading"), load the engine on a worker
thread while start-up progress is logged, open the gate and report SERVING with one "ready" line, then on
SIGTERM/SIGINT report NOT_SERVING, stop accepting, give running streams `drain_s` to finish and stop the engine.
While it serves, its health follows its backend (`watch`) and its engine's progress (`engine_busy`, `stall_s`:
`specdec.serving.stall_watch`), combined by `specdec.rpc.service_health`.
`finish_service` (the spans flushed, one "stopped" line) ends the gateway's life too.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from specdec.rpc.readiness import ReadinessGate
from specdec.rpc.server import AddServicer, start_server
from specdec.rpc.service_health import ServiceHealth
from specdec.rpc.tls import TlsConfig
from specdec.serving.long_lived import freeze_start_up_objects
from specdec.serving.stall_watch import StallWatch
from specdec.telemetry import MODEL_FAMILIES, ServiceMetrics, setup_tracing, shutdown_tracing, start_metrics_server
from specdec.telemetry.grpc_tracing import server_interceptors

log = logging.getLogger(__name__)


@dataclass
class ServiceSpec:
    name: str  # short name for logs and metrics, e.g. "target"
    health_name: str  # full service name, e.g. "specdec.v1.TargetService"
    servicers: Sequence[AddServicer]
    load: Callable[[ServiceMetrics], Awaitable[str]]  # loads the engine; returns a "model ..." description
    close: Callable[[], Awaitable[None]]  # stops the engine after the drain
    host: str
    port: int
    tls: TlsConfig | None
    metrics_port: int = 0
    drain_s: float = 30.0
    # methods traced only under a caller's trace (per-step and polling RPCs: no root trace for each call)
    trace_parent_required: tuple[str, ...] = ()
    model_name: str = ""  # the metrics' model_name label: `model_label(args.model)`
    metric_families: frozenset[str] = MODEL_FAMILIES  # the metric family groups the service sets (FAMILY_GROUPS)
    # while draining: methods still served and whether work its clients come back for is left (`ServerHandle.stop`)
    still_served: frozenset[str] = frozenset()
    busy: Callable[[], bool] | None = None
    more_health_names: tuple[str, ...] = ()  # other services this server hosts (a draft's in-process target)
    # runs while the service serves (cancelled when it drains); `set_ready(False)` reports the service's own name and
    # the overall "" NOT_SERVING (its backend went away: a draft's remote target), `set_ready(True)` SERVING again
    watch: Callable[[Callable[[bool], Awaitable[None]]], Awaitable[None]] | None = None
    # seconds the engine thread has been in its current round of work (`EngineLoop.busy_s`; read once the service
    # serves), and how long a round may last before the service reports itself stalled (0: never)
    engine_busy: Callable[[], float] | None = None
    stall_s: float = 0.0
    engine_which: Callable[[], str] | None = None  # a process of two engine threads: the stalled one's name
    # a verify lane (`specdec.rpc.lane`): its port (0: any free one; None: no lane), the methods it serves, and what
    # to tell once it listens (the port it got)
    lane_port: int | None = None
    lane_methods: tuple[str, ...] = ()
    lane_started: Callable[[int], None] | None = None


async def run_service(spec: ServiceSpec, shutdown: asyncio.Event, ready: Callable[[int], None] | None = None) -> None:
    t0 = time.perf_counter()
    provider = setup_tracing(f"{spec.name}_service")  # OTEL_SERVICE_NAME overrides
    gate = ReadinessGate(spec.health_name)
    metrics = ServiceMetrics(spec.name, model_name=spec.model_name, families=spec.metric_families)
    # before the gRPC server: a port that cannot be had ends the start with nothing to stop (logs its address)
    start_metrics_server(spec.metrics_port, metrics.registry, spec.host, grpc_port=spec.port)
    handle = await start_server(spec.servicers, [spec.health_name, *spec.more_health_names], spec.host, spec.port,
                                spec.tls,
                                interceptors=[gate, *server_interceptors(provider, spec.trace_parent_required)],
                                still_served=spec.still_served)
    if spec.lane_port is not None:
        try:
            port = await handle.start_lane(spec.host, spec.lane_port, spec.lane_methods)
        except BaseException:
            await handle.stop(None)
            raise
        log.info("verify lane on %s:%d (plaintext TCP: %s)", spec.host, port,
                 ", ".join(m.rsplit("/", 1)[-1] for m in spec.lane_methods))
        if spec.lane_started is not None:
            spec.lane_started(port)
    health = ServiceHealth(handle, gate, ("", spec.health_name))
    watches: list[asyncio.Future] = []
    try:
        loading = asyncio.ensure_future(spec.load(metrics))
        stop = asyncio.ensure_future(shutdown.wait())
        await asyncio.wait({loading, stop}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            loading.cancel()
            return
        stop.cancel()
        model = loading.result()
        freeze_start_up_objects()  # the engine lives as long as the service: out of the collector's scans
        gate.open()
        await handle.set_serving(True)
        log.info("%s ready on %s:%d, %s (start-up %.1f s)", spec.name, spec.host, handle.bound_port, model,
                 time.perf_counter() - t0)
        if ready is not None:
            ready(handle.bound_port)
        if spec.watch is not None:
            watches.append(asyncio.ensure_future(spec.watch(health.set_backend)))
        if spec.engine_busy is not None and spec.stall_s > 0:
            stalls = StallWatch(spec.engine_busy, spec.stall_s, f"the {spec.name}'s engine thread", spec.engine_which)
            watches.append(asyncio.ensure_future(stalls.run(health.set_stalled)))
        await shutdown.wait()  # (a watch still running reports nothing: health ignores sets once the drain begins)
        log.info("%s draining (up to %.0f s)", spec.name, spec.drain_s)
        await handle.stop(spec.drain_s, spec.busy)
    finally:
        for watching in watches:
            watching.cancel()
        await spec.close()
        await handle.stop(0)
        finish_service(spec.name)


def finish_service(name: str) -> None:
    """A service process's last step, once its server has stopped: export the spans still queued, then say so in
    one line (a log that ends at "draining" may be a process that hung)."""
    shutdown_tracing()
    log.info("%s stopped", name)
