"""Build and run the gateway: tokenizer, router, servicer and interceptors on one gRPC server.

Health (`specdec.v1.GatewayService` and "") turns SERVING once some pair's target answers SERVING, and stays
so; while no pair is up, Generate answers UNAVAILABLE. `liveness` is SERVING from the start (until the drain):
the gateway process itself is up, whatever its pairs do (a Kubernetes startup/liveness probe: the pairs may take
longer than the gateway's budget to load on a first GPU install).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from grpc_health.v1 import health_pb2

from gateway.auth import ApiKeyFile, ApiKeyInterceptor
from gateway.config import GatewayConfig, GatewayLimits, PairAddress
from gateway.interceptors import AccessLogInterceptor, MetricsInterceptor
from gateway.limits import max_request_bytes
from gateway.model_shape import ModelShape
from gateway.pair_metrics import track_pair_parts
from gateway.router import Router
from gateway.servicer import GATEWAY_SERVICE, GatewayServicer
from specdec.rpc.cli_support import run_cli_service
from specdec.rpc.server import LIVENESS, ServerHandle, start_server
from specdec.rpc.service_runner import finish_service
from specdec.rpc.tls import TlsConfig
from specdec.telemetry import ServiceMetrics, model_label, setup_tracing, start_metrics_server
from specdec.telemetry.grpc_tracing import server_interceptors
from specdec.tokenizer import load_tokenizer
from specdec.v1 import gateway_pb2_grpc

log = logging.getLogger(__name__)


@dataclass
class RunningGateway:
    handle: ServerHandle
    router: Router
    servicer: GatewayServicer
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.handle.bound_port

    async def stop(self, grace_s: float | None = 10.0) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.handle.stop(grace_s)
        await self.router.close()




def server_tls(args: argparse.Namespace) -> TlsConfig | None:
    """The gateway's own TLS from its flags: with `--tls-ca`, clients must present a certificate unless
    `--tls-client-certs optional` (an Ingress in front, clients without one); the pairs are reached with the same
    files either way (`pair_tls`)."""
    tls = TlsConfig.from_args(args)
    optional = getattr(args, "tls_client_certs", "required") == "optional"
    if optional and (tls is None or tls.ca is None):
        log.warning("--tls-client-certs optional does nothing without --tls-ca: no client certificate is asked for "
                    "(the flag is for a gateway given a CA)")
    if tls is not None and tls.require_client_cert and optional:
        return replace(tls, require_client_cert=False)
    return tls


def pair_tls(server_tls: TlsConfig | None) -> TlsConfig | None:
    """The gateway reaches its pairs with the same files: the CA verifies them, the cert is its client identity."""
    if server_tls is None:
        return None
    return TlsConfig(cert=server_tls.cert, key=server_tls.key, ca=server_tls.ca)


async def start_gateway(
    config: GatewayConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    tls: TlsConfig | None = None,
    api_keys: tuple[bytes, ...] | ApiKeyFile = (),
    metrics: ServiceMetrics | None = None,
) -> RunningGateway:
    """Start serving (call inside the event loop); `await gateway.stop()` when done."""
    tokenizer = load_tokenizer(config.model_dir)
    shape = ModelShape.from_dir(config.model_dir, tokenizer.model_vocab_size)
    router = Router.connect(config.pairs, pair_tls(tls), config.health_interval_s, shape)
    servicer = GatewayServicer(tokenizer, router, config.limits, config.model_dir, clients_by_key=bool(api_keys),
                               served_model_name=config.served_model_name, pair_wait_s=config.pair_wait_s)
    interceptors = [*server_interceptors(), AccessLogInterceptor()]
    if metrics is not None:
        interceptors.append(MetricsInterceptor(metrics))
        track_pair_parts(metrics, router)
    if api_keys:
        interceptors.append(ApiKeyInterceptor(api_keys))
    add_servicer = lambda server: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    handle = await start_server([add_servicer], [GATEWAY_SERVICE], host, port, tls, interceptors=interceptors,
                                max_receive_bytes=max_request_bytes(config.limits))
    await handle.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    router.start()
    gateway = RunningGateway(handle, router, servicer)
    gateway._tasks.append(asyncio.create_task(_serving_when_a_pair_is_up(handle, router)))
    return gateway


async def _serving_when_a_pair_is_up(handle: ServerHandle, router: Router) -> None:
    await router.any_up.wait()
    await handle.set_serving(True)
    log.info("serving: %d of %d pairs up", router.pairs_up, len(router.pairs))


async def serve(args: argparse.Namespace, shutdown: asyncio.Event, ready: Callable[[int], None] | None = None) -> None:
    """Run the gateway from its flags until `shutdown` is set, then drain for --drain-seconds."""
    config = GatewayConfig(
        model_dir=args.model,
        pairs=tuple(PairAddress.parse(spec) for spec in args.pair),
        limits=GatewayLimits(args.max_prompt_tokens, args.max_new_tokens, args.max_concurrent_streams,
                             args.max_streams_per_client, args.max_input_chars),
        served_model_name=args.served_model_name,
        pair_wait_s=args.pair_wait_seconds,
    )
    tls = server_tls(args)
    api_keys = ApiKeyFile(args.api_key_file) if args.api_key_file else ()
    setup_tracing("gateway")
    metrics = ServiceMetrics("gateway", model_name=model_label(config.model_dir), families=MetricsInterceptor.FAMILIES)
    metrics_server = start_metrics_server(args.metrics_port, metrics.registry, args.host, grpc_port=args.port)
    gateway = await start_gateway(config, args.host, args.port, tls, api_keys, metrics)
    try:
        pairs = ", ".join(map(str, config.pairs))
        log.info("gateway on %s:%d (%s), pairs: %s", args.host, gateway.port, "TLS" if tls else "plaintext", pairs)
        if ready is not None:
            ready(gateway.port)
        await shutdown.wait()
        log.info("gateway draining (up to %.0f s)", args.drain_seconds)
    finally:
        await gateway.stop(grace_s=args.drain_seconds)
        if metrics_server is not None:
            metrics_server.shutdown()
        finish_service("gateway")


def main(args: argparse.Namespace) -> int:
    """`specdec serve-gateway`."""
    return run_cli_service(args, serve)
