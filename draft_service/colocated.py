"""`serve-draft --target in-process`: the target model in the draft service's own process.

With draft and target on one GPU, every speculative step paid a Verify round trip between two processes: gRPC after
an idle wait, the hand-offs to and from the target's engine thread and the features' copies through host memory,
~2.8 ms of a ~10 ms batch-1 step of an 8B shape on the lent H200 (docs/benchmarks.md). In-process the draft's
scheduler calls the target engine itself, on its own thread, and the features stay on the GPU.

The same server also serves `TargetService` over that engine (its own engine thread, as `serve-target` runs it), so
a gateway pair names this one address for both parts: its plain fallback, `no_speculation` requests and other
drafts' Verify calls reach the same engine. The two threads take turns on the engine under one lock
(`EngineLoop(lock=...)`, `TakingTurns`); the target thread holds it only while it has calls or steps to run.
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import replace

from specdec.engine.factory import build_target
from specdec.engine.fair_lock import FairLock
from specdec.engine.overlap import TakingTurns
from specdec.engine.plain_steps import PLAIN_STEPS
from specdec.errors import TARGET_PREFIX, ConfigError, SpecdecError
from specdec.rpc.tls import TlsConfig
from specdec.telemetry import ServiceMetrics, model_label
from target_service.app import HEALTH_NAME as TARGET_HEALTH_NAME
from target_service.app import METRIC_FAMILIES as TARGET_METRIC_FAMILIES
from target_service.app import PER_STEP_METHODS, add_target_servicer, engine_loop
from target_service.cli import DEFAULT_REQUEST_IDLE_S
from target_service.servicer import TargetServicer, model_info

IN_PROCESS = "in-process"  # the value of --target that asks for it
TARGET_KV_FRACTION = 0.75  # of the GPU memory free after the target's weights (a target alone: GPU_KV_FRACTION)


class LocalTarget(TakingTurns):
    """The draft's target engine in this process: its calls (prefill, verify, release) run on the calling thread,
    under the lock the in-process `TargetService`'s engine thread also holds; otherwise what `TargetClient` is to
    the draft (`model_info`, `feature_dim`, ...), without a wire."""

    concurrent_calls = False
    feature_wire = ""  # the features stay on the device
    addr = IN_PROCESS

    def __init__(self, engine, model_name: str):
        super().__init__(engine, FairLock())  # in turn with the TargetService's engine loop, which takes it again
        self.engine, self.model_name = engine, model_name
        self.feature_dim = 0  # set by the draft's start-up, as on `TargetClient`

    def prefill(self, inputs):
        with _named_target():
            return super().prefill(inputs)

    def verify(self, inputs, **kwargs):
        with _named_target():
            return super().verify(inputs, **kwargs)

    def release(self, request_id):
        with _named_target():
            return super().release(request_id)

    def begin_prefill(self, inp):
        with _named_target():
            return super().begin_prefill(inp)

    def prefill_part(self, request_id):
        with _named_target():
            return super().prefill_part(request_id)

    def hold_places(self, inputs) -> None:
        with self.lock:
            self.engine.hold_places(inputs)

    def model_info(self):
        with self.lock:
            return model_info(self.engine, self.model_name)

    def waits_on_target(self, thread_id: int | None) -> bool:
        """Never: the target's forwards run on the calling thread (its own stall counts as the draft's)."""
        return False

    def since_call(self, thread_id: int | None) -> float | None:
        """None: no call waits on another process (`TargetClient.since_call`)."""
        return None

    def cancel_prefill(self, request_id: str) -> None:
        """Nothing to drop: an in-process prefill is a forward on this thread, not a call in flight."""

    def close(self) -> None:
        pass


@contextlib.contextmanager
def _named_target():
    """The target's refusals say whose they are, as a remote target's do (`target: ...`, `TargetClient`): the
    client of a draft's Generate then knows which part refused it (an id held on the target by another caller)."""
    try:
        yield
    except SpecdecError as exc:
        raise type(exc)(f"{TARGET_PREFIX}{exc}") from exc


def check_args(args: argparse.Namespace) -> None:
    """Flags that only mean something for a target across the wire are refused with `--target in-process`, and
    the in-process target's own flag without it."""
    if args.target != IN_PROCESS:
        if getattr(args, "request_idle_seconds", None) is not None:
            raise ConfigError("--request-idle-seconds is the in-process target's (--target in-process); a target "
                              "service takes it itself")
        return
    if TlsConfig.from_args(args, prefix="target-") is not None:
        raise ConfigError("--target in-process: the target runs in this process; drop the --target-tls-* flags")
    if getattr(args, "feature_wire", "native") != "native":
        raise ConfigError("--target in-process: the features stay on the device; drop --feature-wire")
    if getattr(args, "target_wait_seconds", None) is not None:
        raise ConfigError("--target in-process: the target loads in this process, nothing to wait for; drop "
                          "--target-wait-seconds")


def load_target(args: argparse.Namespace, opts) -> LocalTarget:
    """The target engine from `--target-model` (a checkpoint directory, or a preset name with `--load-format
    dummy`), with this service's engine flags (device, dtype, attention backend, KV pages, CUDA graphs, ...).
    Without --num-pages on a GPU its pool takes `TARGET_KV_FRACTION` of the memory left after its weights, not the
    whole `GPU_KV_FRACTION` a target alone takes: the draft's weights, its pool (`draft_options`) and both engines'
    CUDA graphs come after it on the same GPU."""
    if not opts.num_pages:
        opts = replace(opts, kv_fraction=TARGET_KV_FRACTION)
    engine = build_target(args.target_model, opts)
    return LocalTarget(engine, args.target_model)  # the name `serve-target --model` would report


def draft_options(opts, target: LocalTarget):
    """The draft engine's options beside its in-process target: without --num-pages, as many KV pages as the
    target's pool has (every request holds pages in both; a pool sized from the memory left would take it all)."""
    return opts if opts.num_pages else replace(opts, num_pages=target.engine.kv.num_total_pages)


class ColocatedTargetService:
    """`TargetService` over a `LocalTarget`'s engine, on the draft's server: registered before the server starts,
    serving once `start` has its engine."""

    health_name = TARGET_HEALTH_NAME
    per_step_methods = PER_STEP_METHODS

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.servicer = TargetServicer(None, None, args.target_model)
        self.lock = None  # the target engine's, shared with the draft's calls (`start`)

    def add_to(self, server) -> None:
        add_target_servicer(self.servicer, server)

    def start(self, target: LocalTarget, max_batch_size: int, draft_metrics) -> None:
        """Start its engine thread; its metrics are `serve-target`'s, beside the draft's on the same /metrics
        (`service="target"`)."""
        idle_s = self.args.request_idle_seconds
        metrics = ServiceMetrics("target", model_name=model_label(self.args.target_model),
                                 families=TARGET_METRIC_FAMILIES, sibling_of=draft_metrics)
        loop = engine_loop(target.engine, max_batch_size, self.args.max_queue_wait_seconds, PLAIN_STEPS,
                           DEFAULT_REQUEST_IDLE_S if idle_s is None else idle_s, metrics, lock=target.lock)
        loop.start()
        self.lock = target.lock
        self.servicer.engine, self.servicer.loop, self.servicer.metrics = target.engine, loop, metrics

    def busy(self) -> bool:
        """Requests the target holds (its drafts come back for them while draining)."""
        return self.servicer.engine is not None and bool(self.servicer.engine.requests)

    def busy_s(self) -> float:
        """How long its engine thread has been in its current round (`EngineLoop.busy_s`; 0 before `start`)."""
        return self.servicer.loop.busy_s() if self.servicer.loop is not None else 0.0

    def holds_engine(self) -> bool:
        """Whether its engine thread holds the target engine (the lock the draft's calls take in turn with it)."""
        loop = self.servicer.loop
        return loop is not None and loop.thread_id is not None and self.lock.holder == loop.thread_id

    def stop(self) -> None:
        if self.servicer.loop is not None:
            self.servicer.loop.stop()
