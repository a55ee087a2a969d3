"""Assemble the target service: engine, engine thread, servicer, server."""

from __future__ import annotations

import asyncio
import logging
import time

from specdec.engine.factory import build_target
from specdec.engine.scheduler import Scheduler
from specdec.errors import ConfigError
from specdec.rpc.service_runner import ServiceSpec, run_service
from specdec.rpc.tls import TlsConfig
from specdec.rpc.wire import add_servicer
from specdec.serving.engine_args import engine_options, plain_steps
from specdec.serving.engine_loop import EngineLoop
from specdec.telemetry import model_label
from specdec.v1 import target_pb2
from target_service.servicer import TargetServicer

log = logging.getLogger(__name__)
STALL_SLACK_S = 1.0  # a sweep this much later than twice its interval means the target stood still (`IdleRelease`)
HEALTH_NAME = "specdec.v1.TargetService"
# what the target sets: gauges, verify batch sizes, step phases (no request latencies: the draft has those; no
# speculation counters: the draft counts them)
METRIC_FAMILIES = frozenset({"running", "waiting", "kv", "batch", "phases", "engine"})
# a draft's calls for the requests it holds here (one short Verify a step): traced only under the draft's trace, and
# still served while draining (the drafts finish those requests; new Prefills and Generates are refused)
PER_STEP_METHODS = tuple(f"/{HEALTH_NAME}/{m}" for m in ("Verify", "Release", "GetModelInfo"))
LANE_METHODS = (f"/{HEALTH_NAME}/Verify",)  # what the verify lane serves (`--verify-lane-port`)


async def serve(args, shutdown: asyncio.Event, ready=None) -> None:
    opts = engine_options(args)
    steps = plain_steps(args)
    tls = TlsConfig.from_args(args)
    lane_port = getattr(args, "verify_lane_port", None)
    if lane_port is not None and tls is not None:
        raise ConfigError("--verify-lane-port: the verify lane is plaintext TCP, and this target serves gRPC over "
                          "TLS; drop --verify-lane-port (its drafts then verify over gRPC) or TLS")
    if lane_port and lane_port in (args.port, getattr(args, "metrics_port", 0)):
        raise ConfigError(f"--verify-lane-port {lane_port} is also this target's gRPC or metrics port")
    servicer = TargetServicer(None, None, args.model)
    state = {}

    async def load(metrics) -> str:
        engine = await asyncio.to_thread(build_target, args.model, opts)
        loop = engine_loop(engine, opts.max_batch_size, args.max_queue_wait_seconds, steps,
                           args.request_idle_seconds, metrics)
        loop.start()
        servicer.engine, servicer.loop, servicer.metrics = engine, loop, metrics
        state["loop"], state["engine"] = loop, engine
        return f"model {args.model} ({engine.cfg.architecture}, {engine.device}, max context {engine.max_context})"

    async def close() -> None:
        if "loop" in state:
            await asyncio.to_thread(state["loop"].stop)

    spec = ServiceSpec(
        name="target", health_name=HEALTH_NAME,
        servicers=[lambda s: add_target_servicer(servicer, s)],
        load=load, close=close, host=args.host, port=args.port, tls=tls,
        metrics_port=args.metrics_port, drain_s=args.drain_seconds,
        trace_parent_required=PER_STEP_METHODS,
        model_name=model_label(args.model), metric_families=METRIC_FAMILIES,  # args.model: --config NAME if given
        still_served=frozenset(PER_STEP_METHODS),
        busy=lambda: "engine" in state and bool(state["engine"].requests),
        engine_busy=lambda: state["loop"].busy_s(), stall_s=args.engine_stall_seconds,
        lane_port=lane_port, lane_methods=LANE_METHODS,
        lane_started=lambda bound: setattr(servicer, "verify_lane_port", bound),
    )
    await run_service(spec, shutdown, ready)


def add_target_servicer(servicer: TargetServicer, server) -> None:
    add_servicer(target_pb2.DESCRIPTOR.services_by_name["TargetService"], servicer, server)


def engine_loop(engine, max_batch_size: int, max_queue_wait_s: float, plain_steps: int, request_idle_s: float,
                metrics, lock=None) -> EngineLoop:
    """The target's engine thread (not started): calls from the servicer, plain `Generate` steps, and the release
    of requests no call has named for `request_idle_s` (0: never); its gauges on `metrics`. `lock`: shared with
    another thread that drives the same engine (`EngineLoop`)."""
    loop = EngineLoop(Scheduler(engine, None, engine.max_context, max_batch_size, max_queue_wait_s=max_queue_wait_s,
                                plain_steps=plain_steps),
                      "target-engine", engine.device, lock=lock)
    kv = engine.kv  # gauges read at scrape time: Verify and Prefill run between steps, not in them
    metrics.track(kv_pages=kv.gauges,
                  running=lambda: len(engine.requests),
                  # plain Generate's queue and the drafts' requests waiting for pages (QA: a draft's request waiting
                  # for the target's pages was counted by GetModelInfo but not by this gauge)
                  waiting=lambda: engine.page_queue.count_with(s.request_id for s in list(loop.scheduler.waiting)),
                  engine_busy=loop.busy_s)
    if request_idle_s > 0:
        loop.chore_every_s = min(5.0, request_idle_s / 4)
        loop.chore = IdleRelease(engine, request_idle_s, loop.chore_every_s)
    return loop


class IdleRelease:
    """The engine loop's chore (`--request-idle-seconds`): release the requests no call has named for `idle_s`.

    A sweep that comes much later than its interval (the target itself stood still: stopped, paused with its VM,
    or its engine thread held by one long step) releases nothing and counts every request as named now: their
    drafts may have been waiting on the target all along, their next Verify still queued behind the stall. Before,
    a target frozen past the limit released the requests of a live draft as it woke (NOT_FOUND on its next
    Verify, 3 of 3 in a QA run with the limit at 5 s)."""

    def __init__(self, engine, idle_s: float, every_s: float) -> None:
        self.engine, self.idle_s, self.every_s = engine, idle_s, every_s
        self.last = time.monotonic()

    def __call__(self) -> None:
        now = time.monotonic()
        stalled = now - self.last > 2 * self.every_s + STALL_SLACK_S
        self.last = now
        if stalled:
            self.engine.mark_all_named()
            return
        released = self.engine.release_idle(self.idle_s)
        if released:
            shown = ", ".join(repr(r) for r in released[:8]) + (" ..." if len(released) > 8 else "")
            log.warning("released %d requests no call named for %.0f s (their draft is gone?): %s", len(released),
                        self.idle_s, shown)
