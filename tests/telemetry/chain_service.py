"""One hop of a tiny gateway -> draft -> target chain, run as its own process by the tracing tests.

    python tests/telemetry/chain_service.py ROLE SERVICE_NAME_DEFAULT

Prints its port on stdout when serving; on SIGTERM stops, flushes its spans and exits. Tracing is configured
only by the environment (OTEL_*, SPECDEC_STEP_SPAN_RATIO), as in the real services. Messages are JSON bytes
({"request_id": ..., "route": [next addresses]}) over generic handlers, so no protos are needed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from types import SimpleNamespace

import grpc

from specdec.telemetry import (
    StepSpanSampler,
    TelemetryConfig,
    bind_request_id,
    setup_logging,
    setup_tracing,
    shutdown_tracing,
)
from specdec.telemetry.grpc_tracing import client_interceptors, server_interceptors

logger = logging.getLogger("chain")

GATEWAY_GENERATE = "/specdec.v1.Gateway/Generate"
DRAFT_GENERATE = "/specdec.v1.DraftService/Generate"
TARGET_VERIFY = "/specdec.v1.TargetService/Verify"
NUM_STEPS = 2


def decode(data: bytes) -> SimpleNamespace:
    return SimpleNamespace(**json.loads(data))


def encode(message: dict | SimpleNamespace) -> bytes:
    return json.dumps(vars(message) if isinstance(message, SimpleNamespace) else message).encode()


class Hop:
    def __init__(self, role: str) -> None:
        self.role = role
        self.step_spans = StepSpanSampler.from_config(TelemetryConfig.from_env())
        self.channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self.channels:
            self.channels[address] = grpc.aio.insecure_channel(address, interceptors=client_interceptors())
        return self.channels[address]

    async def gateway_generate(self, request, context):
        with bind_request_id(request.request_id):
            logger.info("gateway forwards", extra={"role": self.role})
            forward = {"request_id": request.request_id, "route": request.route[1:]}
            stream = self.channel(request.route[0]).unary_stream(DRAFT_GENERATE)(encode(forward))
            async for response in stream:
                yield response

    async def draft_generate(self, request, context):
        verify = self.channel(request.route[0]).unary_unary(TARGET_VERIFY)
        with bind_request_id(request.request_id):
            logger.info("draft runs", extra={"role": self.role})
            for step in range(NUM_STEPS):
                sampled = self.step_spans.sample_step()
                with self.step_spans.span("draft.propose", sampled, batch_size=1, num_draft_tokens=4):
                    pass
                with self.step_spans.span("draft.verify", sampled, batch_size=1, num_draft_tokens=4) as span:
                    reply = decode(await verify(encode({"request_id": request.request_id, "step": step})))
                    if span is not None:
                        span.set_attribute("accepted", reply.accepted)
                with self.step_spans.span("draft.extend", sampled, batch_size=1):
                    pass
                yield encode({"token": step, "accepted": reply.accepted})

    async def target_verify(self, request, context):
        with bind_request_id(request.request_id):
            logger.info("target verifies", extra={"role": self.role})
        return encode({"accepted": 3})

    def handler(self) -> grpc.GenericRpcHandler:
        io = {"request_deserializer": decode, "response_serializer": lambda data: data}
        methods = {
            "gateway": (
                "specdec.v1.Gateway",
                {"Generate": grpc.unary_stream_rpc_method_handler(self.gateway_generate, **io)},
            ),
            "draft": (
                "specdec.v1.DraftService",
                {"Generate": grpc.unary_stream_rpc_method_handler(self.draft_generate, **io)},
            ),
            "target": (
                "specdec.v1.TargetService",
                {"Verify": grpc.unary_unary_rpc_method_handler(self.target_verify, **io)},
            ),
        }
        service, handlers = methods[self.role]
        return grpc.method_handlers_generic_handler(service, handlers)


async def serve(role: str) -> None:
    server = grpc.aio.server(interceptors=server_interceptors(parent_required={TARGET_VERIFY}))
    server.add_generic_rpc_handlers((Hop(role).handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(port, flush=True)
    await stop.wait()
    await server.stop(grace=1.0)


def main() -> None:
    role, service_name_default = sys.argv[1], sys.argv[2]
    setup_logging("INFO", "json")
    setup_tracing(service_name_default)
    try:
        asyncio.run(serve(role))
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
