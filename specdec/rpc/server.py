"""Start a gRPC aio server the way every specdec service does, and run it until a signal drains it.

Each server gets explicit message limits and keepalive (`options`), `grpc.health.v1` (every service name and
the overall "" NOT_SERVING until `set_serving(True)`: a service flips it once its model is loaded), server
reflection for all its services, optional TLS / mutual TLS, and INVALID_ARGUMENT for a request whose bytes do
not parse (`decode_guard`: grpc itself answers UNKNOWN and logs a traceback).

    async def serve(shutdown: asyncio.Event) -> None:
        handle = await start_server(
            [lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(servicer, s)],
            [TARGET_SERVICE], host, port, TlsConfig.from_args(args))
        await engine.load()
        await handle.set_serving(True)
        await shutdown.wait()          # SIGTERM / SIGINT
        await handle.stop(grace_s=30)  # NOT_SERVING first, then finish in-flight calls

    run_server_forever(serve)
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import ConfigError
from specdec.rpc.decode_guard import DecodeGuard
from specdec.rpc.drain_gate import DrainGate
from specdec.rpc.health_list import HealthServicer
from specdec.rpc.lane_server import LaneServer
from specdec.rpc.options import DEFAULT_MAX_MESSAGE_BYTES, server_options
from specdec.rpc.reflection import enable_reflection
from specdec.rpc.tls import TlsConfig, add_tls_args

__all__ = ["LIVENESS", "ServerHandle", "TlsConfig", "add_tls_args", "run_server_forever", "start_server"]

log = logging.getLogger(__name__)

AddServicer = Callable[[grpc.aio.Server], None]
BUSY_POLL_S = 0.05  # how often a drain asks whether the service still holds work (`ServerHandle.stop`)
# before the grpc server stops, a drain waits until no call arrived for QUIET_S, LINGER_MAX_S at most
# (`DrainGate.wait_quiet`): clients that go elsewhere once refused have then gone
QUIET_S = 0.1
LINGER_MAX_S = 1.0
END_WAIT_S = 1.0  # how long the calls ended at a drain's end get to send their UNAVAILABLE before the server stops
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name  # grpc.health.v1.Health
# health name of the process itself: SERVING while it runs, whatever its service's readiness (a Kubernetes liveness
# probe on it does not restart a process whose backends are away: the gateway's pairs, a draft's remote target)
LIVENESS = "liveness"


@dataclass
class ServerHandle:
    """A started server: its bound port, its health state and its shutdown."""

    server: grpc.aio.Server
    health: HealthServicer
    bound_port: int
    health_names: tuple[str, ...]
    gate: DrainGate = field(default_factory=DrainGate)  # refuses new calls once `stop` begins
    # the servicers' registered handlers by full method name, and the interceptors that run every call (outermost
    # first): what a verify lane serves its calls with (`start_lane`)
    handlers: dict = field(default_factory=dict)
    chain: tuple = ()
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    lane: LaneServer | None = None

    async def start_lane(self, host: str, port: int, methods) -> int:
        """Serve `methods` (full names of unary methods) on a verify lane (`specdec.rpc.lane`) at host:port too, each
        call through this server's handlers and interceptors; -> the port it listens on."""
        self.lane = LaneServer(self.handlers, self.chain, methods, self.max_message_bytes)
        try:
            return await self.lane.start(host, port)
        except OSError as exc:
            self.lane = None
            raise ConfigError(f"cannot listen for the verify lane on {host}:{port}: "
                              f"{_why_not_bound(host, port) or exc}") from None

    async def set_serving(self, serving: bool, names: Sequence[str] | None = None) -> None:
        """Set every health name (and the overall "") to SERVING or NOT_SERVING; `names`: those only."""
        statuses = health_pb2.HealthCheckResponse
        await self.set_status(statuses.SERVING if serving else statuses.NOT_SERVING, names)

    async def set_status(self, status: int, names: Sequence[str] | None = None) -> None:
        """Set every health name (and the overall "") to `status` (a `HealthCheckResponse.ServingStatus`: UNKNOWN
        says an engine stalled, `specdec.rpc.service_health`); `names`: those only."""
        for name in self.all_names if names is None else names:
            await self.health.set(name, status)

    @property
    def all_names(self) -> tuple[str, ...]:
        """Every name health answers for: the overall "" and `health_names`."""
        return ("", *self.health_names)

    async def stop(self, grace_s: float | None = 10.0, busy: Callable[[], bool] | None = None) -> None:
        """New calls refused (UNAVAILABLE; health checks and the gate's `still_served` methods still answer),
        NOT_SERVING for good (load balancers stop routing), then let in-flight calls finish for grace_s (None:
        cancel them at once), then stop the server. `busy`: the service still holds work its clients will come
        back for in calls the gate still serves (the target's requests, verified one short call a step): the drain
        also waits, up to the same grace, until it says False.

        The server keeps running while calls finish, so a call arriving then gets the gate's UNAVAILABLE, not the
        CANCELLED a stopping grpc server gives calls it no longer matches to a handler; and, within the grace, until
        calls stop arriving (`QUIET_S`, `LINGER_MAX_S`: clients refused go elsewhere)."""
        self.gate.draining = True
        t0 = time.monotonic()
        await self.health.enter_graceful_shutdown()
        if grace_s is None:
            await self._stop_lane()
            await self.server.stop(None)
            return
        left = lambda: grace_s - (time.monotonic() - t0)  # noqa: E731
        while busy is not None and busy() and left() > 0:
            await asyncio.sleep(min(BUSY_POLL_S, max(left(), 0.0)))
        if not await self.gate.wait_idle(left()):
            self.gate.end_running(f"the server is shutting down: its drain period ({grace_s:g} s) ended before "
                                  "this call did; retry on another replica")
            await self.gate.wait_idle(END_WAIT_S)
        await self.gate.wait_quiet(QUIET_S, min(LINGER_MAX_S, left()))
        await self._stop_lane()
        await self.server.stop(max(left(), 0.0))

    async def _stop_lane(self) -> None:
        if self.lane is not None:
            await self.lane.stop()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_server(
    servicers: Sequence[AddServicer],
    health_names: Sequence[str],
    host: str = "0.0.0.0",
    port: int = 0,
    tls: TlsConfig | None = None,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_receive_bytes: int | None = None,
    still_served: frozenset[str] = frozenset(),
) -> ServerHandle:
    """Build, bind and start a server; port 0 picks a free port (see `bound_port`).

    servicers: callables that add one servicer each, e.g. `lambda s: add_XServicer_to_server(impl, s)`.
    health_names: the full names of the services added (e.g. "specdec.v1.TargetService"); they are reported
    by health (NOT_SERVING until `set_serving(True)`) and listed by reflection (LIVENESS by health only).
    """
    gate = DrainGate(still_served)  # first: a call refused while draining reaches no other interceptor
    # The decode guard last, nearest the servicer: a request that does not parse then passes every other
    # interceptor like any refused call (counted by the gate, refused while loading, seen by the gateway's API-key
    # check and access log as INVALID_ARGUMENT). They all keep the handler's request_deserializer, so the tolerant
    # one the guard sets is the one grpc calls.
    chain = [gate, *interceptors, DecodeGuard()]
    server = grpc.aio.server(options=server_options(max_message_bytes, max_receive_bytes), interceptors=chain)
    recorder = _Recorder(server)
    for add in servicers:
        add(recorder)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # reflection lists the services; a health-only name (LIVENESS) is none, and listed it made `grpcurl describe`
    # fail on the draft ("Symbol not found: liveness")
    services = [name for name in health_names if name != LIVENESS]
    enable_reflection(server, (*services, HEALTH_SERVICE))
    bound_port = _bind(server, host, port, tls)
    handle = ServerHandle(server, health_servicer, bound_port, tuple(health_names), gate, recorder.handlers,
                          tuple(chain), max_receive_bytes or max_message_bytes)
    await handle.set_serving(False)
    await server.start()
    log.info("listening on %s:%d (%s)", host, bound_port, "TLS" if tls else "plaintext")
    return handle


class _Recorder:
    """The server, as the servicers' `add` functions see it: the method handlers they register are kept (by full
    method name) for a verify lane to serve."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server, self.handlers = server, {}

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self._server.add_registered_method_handlers(service, handlers)
        self.handlers.update({f"/{service}/{name}": handler for name, handler in handlers.items()})

    def __getattr__(self, name: str):
        return getattr(self._server, name)


def _bind(server: grpc.aio.Server, host: str, port: int, tls: TlsConfig | None) -> int:
    address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, tls.server_credentials())
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen on {address}: {_why_not_bound(host, port) or exc}") from exc
    if bound == 0:
        why = _why_not_bound(host, port) or "in use or not a local address?"
        raise ConfigError(f"cannot listen on {address}: {why}")
    return bound


def _why_not_bound(host: str, port: int) -> str | None:
    """Why a socket cannot listen at host:port, asked of the OS (gRPC's own error says "Failed to bind ... set
    GRPC_VERBOSITY=debug" for a port in use, QA); None when it could (the cause was gRPC's)."""
    bare = host.strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in bare else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((bare, port))
    except OSError as exc:
        return {errno.EADDRINUSE: f"port {port} is already in use (another process listens there)",
                errno.EADDRNOTAVAIL: f"{host} is not an address of this machine",
                errno.EACCES: f"no permission to listen on port {port}"}.get(exc.errno, exc.strerror or str(exc))
    return None


def run_server_forever(main: Callable[[asyncio.Event], Awaitable[None]], use_uvloop: bool = True) -> None:
    """Run `main(shutdown)` on uvloop (when installed) until it returns.

    The first SIGTERM or SIGINT sets `shutdown`, and `main` drains (typically `await handle.stop(grace)`)
    and returns; a second signal cancels `main` outright.
    """
    with asyncio.Runner(loop_factory=_uvloop_factory() if use_uvloop else None) as runner:
        runner.run(_run_with_signals(main))


def _uvloop_factory():
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _run_with_signals(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    loop = asyncio.get_running_loop()
    shutdown = asyncio.Event()
    task = asyncio.current_task()
    signals = (signal.SIGTERM, signal.SIGINT)

    def on_signal(sig: signal.Signals) -> None:
        if shutdown.is_set():
            log.warning("%s again: stopping without waiting for the drain", sig.name)
            task.cancel()
            return
        log.info("%s: draining", sig.name)
        shutdown.set()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await main(shutdown)
    except asyncio.CancelledError:
        if not shutdown.is_set():
            raise
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
