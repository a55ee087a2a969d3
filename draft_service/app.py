"""Assemble the draft service: connect to the target, load the EAGLE head, run the speculative loop."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable

from draft_service.colocated import IN_PROCESS, ColocatedTargetService, draft_options, load_target
from draft_service.colocated import check_args as check_target_args
from draft_service.servicer import DraftServicer
from draft_service.target_client import NotGrpc, TargetClient
from draft_service.target_watch import TargetWatch
from specdec.config import ModelConfig
from specdec.engine.adaptive import FULL, SpeculationPolicy, budget_menu
from specdec.engine.calibration import batch_sizes_up_to, calibrate
from specdec.engine.draft_engine import SpecConfig
from specdec.engine.factory import build_draft
from specdec.engine.generate import feature_layers_for
from specdec.engine.overlap import TwoBatchOverlap
from specdec.engine.requests import StepTimings
from specdec.engine.scheduler import Scheduler
from specdec.engine.warmup import warm_verify_shapes
from specdec.errors import ConfigError, NotReady
from specdec.rpc.server import LIVENESS
from specdec.rpc.service_runner import ServiceSpec, run_service
from specdec.rpc.tensor_codec import FP8_ROWS
from specdec.rpc.tls import TlsConfig
from specdec.serving.engine_args import engine_options, plain_steps
from specdec.serving.engine_loop import EngineLoop
from specdec.telemetry import StepSpanSampler, TelemetryConfig, model_label
from specdec.v1 import draft_pb2_grpc

log = logging.getLogger(__name__)
HISTORY_ENV = "SPECDEC_POLICY_HISTORY"  # diagnosis: where `--speculation auto` writes its records at shutdown
HEALTH_NAME = "specdec.v1.DraftService"
DEFAULT_TARGET_WAIT_S = 600.0  # --target-wait-seconds: how long start-up waits for a remote target
RELEASE_EVERY_S = 1.0  # how often the engine thread releases what ended while the target was away, once it is back


class StartCancelled(NotReady):
    """A shutdown came while the service was still starting (waiting for its target)."""


def _connect(client: TargetClient, timeout_s: float, stop: threading.Event):
    """Wait for the target to answer GetModelInfo (it may still be loading), until `stop` is set: SIGTERM while
    waiting must end the process then, not once --target-wait-seconds ran out (a pod's grace period is shorter)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.model_info()
        except (ConfigError, NotGrpc) as exc:
            raise ConfigError(f"--target {client.addr}: {exc}") from None
        except NotReady as exc:
            if time.monotonic() > deadline:
                raise NotReady(f"target at {client.addr} not ready after {timeout_s:.0f} s: {exc}") from None
            if stop.wait(0.5):
                raise StartCancelled("shutting down while waiting for the target") from None


def _load(args, opts, spec: SpecConfig, off: bool, stop: threading.Event):
    """`off` (`--speculation off`): plain decoding through Verify, no features asked and none accepted. Runs on a
    worker thread; `stop` (set when the start is cancelled) ends it between its stages."""
    target_cfg = ModelConfig.from_hf(args.target_model)
    if args.target == IN_PROCESS:
        log.info("loading the target %s in this process", args.target_model)
        client = load_target(args, opts)
        info = client.model_info()
        opts = draft_options(opts, client)
    else:
        client = TargetClient(args.target, TlsConfig.from_args(args, prefix="target-"), device=opts.device,
                              feature_wire=FP8_ROWS if getattr(args, "feature_wire", "native") == "fp8" else "",
                              features=not off)
        log.info("connecting to target at %s", args.target)
        wait_s = DEFAULT_TARGET_WAIT_S if args.target_wait_seconds is None else args.target_wait_seconds
        info = _connect(client, wait_s, stop)  # (`model_info` takes the target's part size, each time it answers)
    _raise_mismatch(target_mismatch(args, target_cfg, spec, info))  # what `misfit` asks again of every later answer
    max_context = min(info.max_context_len, opts.max_context or info.max_context_len)
    log.info("target %s: context length %d", info.model, max_context)
    if stop.is_set():
        raise StartCancelled("shutting down before the draft model was built")
    engine = build_draft(args.model, args.target_model, spec, opts, max_context)
    _raise_mismatch(_feature_layers_mismatch(args, feature_layers_for(engine), info))
    client.feature_dim = info.hidden_size * max(1, len(feature_layers_for(engine)))
    sizes = [] if off else [spec.num_draft_tokens if b == FULL else b for b in budget_menu(spec.num_draft_tokens)]
    warm_verify_shapes(client, sizes, spec.topk, feature_layers_for(engine), info.vocab_size, features=not off)
    return client, engine, max_context, info, _misfit(args, target_cfg, spec, feature_layers_for(engine), max_context)


def target_mismatch(args, target_cfg: ModelConfig, spec: SpecConfig, info) -> str | None:
    """Why the target that answered (`info`, its GetModelInfo) cannot serve this draft, or None: another model than
    --target-model, or trees bigger than it verifies. Checked at start-up and whenever it answers again
    (`TargetWatch`: a target restarted as another model)."""
    if (info.vocab_size, info.hidden_size, info.num_layers) != \
            (target_cfg.vocab_size, target_cfg.hidden_size, target_cfg.num_layers):
        return (f"target at {args.target} serves {info.model} (vocab {info.vocab_size}, hidden {info.hidden_size}, "
                f"{info.num_layers} layers), which does not match --target-model {args.target_model} (vocab "
                f"{target_cfg.vocab_size}, hidden {target_cfg.hidden_size}, {target_cfg.num_layers} layers)")
    if info.max_draft_tokens and spec.num_draft_tokens > info.max_draft_tokens:
        return (f"--num-draft-tokens {spec.num_draft_tokens}: the target at {args.target} verifies trees of at most "
                f"{info.max_draft_tokens} draft tokens")
    return None


def _feature_layers_mismatch(args, layers: tuple[int, ...], info) -> str | None:
    """An EAGLE-3 head reads the target's hidden states at its trained layers: one the target does not have means
    the head was trained for another target. Before, the draft started and reported SERVING, its warm-up logged a
    warning, and every speculative request failed INVALID_ARGUMENT (blaming the client)."""
    bad = [i for i in layers if not 0 <= i <= info.num_layers]
    if bad:
        return (f"the draft {args.model} reads the target's hidden states at layer {bad[0]} (of {list(layers)}), "
                f"but the target at {args.target} ({info.model}) has {info.num_layers} layers: the head was trained "
                "for another target")
    return None


def _context_mismatch(args, max_context: int, info) -> str | None:
    if info.max_context_len < max_context:
        return (f"the target at {args.target} ({info.model}) takes contexts of {info.max_context_len} tokens, this "
                f"draft was started for {max_context}")
    return None


def _misfit(args, target_cfg: ModelConfig, spec: SpecConfig, layers: tuple[int, ...],
            max_context: int) -> Callable[[object], str | None]:
    """What `TargetWatch` asks of each answer of the target: the start-up checks, and the context the draft serves."""
    return lambda info: (target_mismatch(args, target_cfg, spec, info) or _feature_layers_mismatch(args, layers, info)
                         or _context_mismatch(args, max_context, info))


def _raise_mismatch(problem: str | None) -> None:
    if problem is not None:
        raise ConfigError(problem)


async def serve(args, shutdown: asyncio.Event, ready=None) -> None:
    opts = engine_options(args)
    steps = plain_steps(args)
    off = args.speculation == "off"  # the scheduler runs without the draft engine: plain steps through Verify
    if not args.admission_gather_ms >= 0:  # (nan too)
        raise ConfigError(f"--admission-gather-ms {args.admission_gather_ms}: milliseconds >= 0 (0 = off)")
    if args.two_batch_overlap < 0:
        raise ConfigError(f"--two-batch-overlap {args.two_batch_overlap}: a request count >= 0 (0 = off)")
    if not args.prompt_feature_mb >= 0:
        raise ConfigError(f"--prompt-feature-mb {args.prompt_feature_mb}: megabytes >= 0 (0 = whole prompts)")
    if args.plain_calls_in_flight < 1:
        raise ConfigError(f"--plain-calls-in-flight {args.plain_calls_in_flight}: a call count >= 1 (1 = one at a "
                          "time)")
    spec = SpecConfig(args.num_steps, args.topk, args.num_draft_tokens).validate()
    servicer = DraftServicer(args.model)
    state = {}
    check_target_args(args)
    # --target in-process: this server serves TargetService over the draft's own target engine
    colocated = ColocatedTargetService(args) if args.target == IN_PROCESS else None
    calibration_sizes = batch_sizes_up_to(calibration_max_batch(args, opts))

    def engine_busy() -> float:
        """The longer round of this process's engine threads (the in-process target's runs on its own); a draft
        thread waiting for its remote target's answer counts as moving, and its round counts from its last answer:
        the target's own watch judges the target,
        and the draft's target watch ends calls it does not answer (a burst of long prompts' admission waits for the
        target's prefills for as long as they take)."""
        loop, client = state.get("loop"), state.get("client")
        if loop is None:  # (a scrape during start-up)
            return 0.0
        own = 0.0 if client.waits_on_target(loop.thread_id) else loop.busy_s()
        since = client.since_call(loop.thread_id)  # the round's wait for the target is not the draft's own work
        own = own if since is None else min(own, since)
        return max(own, colocated.busy_s() if colocated is not None else 0.0)

    def stalled_thread() -> str:
        """Which engine thread a stall is in: with the target in-process, its own thread where that one has been
        in its round longer, or holds the target engine the draft's thread waits for (QA: a frozen target thread
        was named the draft's, whose step waited for it)."""
        loop = state.get("loop")
        if colocated is not None and (colocated.holds_engine() or
                                      (loop is not None and colocated.busy_s() >= loop.busy_s())):
            return "the in-process target's engine thread"
        return "the draft's engine thread"

    async def load(metrics) -> str:
        stop = threading.Event()
        try:
            client, engine, max_context, info, misfit = await asyncio.to_thread(_load, args, opts, spec, off, stop)
        except asyncio.CancelledError:  # a shutdown during start-up: the worker thread must end too
            stop.set()
            raise
        policy = SpeculationPolicy(budget_menu(spec.num_draft_tokens)) if args.speculation == "auto" else None
        if policy is not None and os.environ.get(HISTORY_ENV):
            policy.history = []  # written out at shutdown (`close`)
        if policy is not None:
            metrics.track_policy(policy)
        sched = Scheduler(client, None if off else engine, max_context, opts.max_batch_size,
                          () if off else feature_layers_for(engine),
                          max_queue_wait_s=args.max_queue_wait_seconds, plain_steps=steps,
                          gather_s=args.admission_gather_ms / 1e3,
                          prompt_feature_rows=int(args.prompt_feature_mb * 2**20) // feature_row_bytes(client, engine),
                          step_spans=StepSpanSampler.from_config(TelemetryConfig.from_env()), policy=policy,
                          overlap=TwoBatchOverlap(0 if off else args.two_batch_overlap, engine.device,
                                                  args.plain_calls_in_flight))
        if colocated is not None:
            colocated.start(client, opts.max_batch_size, metrics)
            state["colocated"] = colocated
        loop = EngineLoop(sched, "draft-engine", engine.device)
        if colocated is None:  # requests that ended while the target was away: released once it answers again
            loop.chore, loop.chore_every_s = lambda: _release_pending(client, state.get("watch")), RELEASE_EVERY_S
        loop.on_leave = client.cancel_prefill  # a client leaving during its admission: its Prefill is dropped
        phases = StepPhases(sched.timings)
        loop.on_step = lambda events: (_observe(metrics, engine, events), phases.observe(metrics))
        kv = engine.kv
        metrics.track(kv_pages=kv.gauges,
                      running=lambda: len(sched.running), waiting=lambda: len(sched.waiting) + sched.num_admitting,
                      engine_busy=engine_busy)
        loop.start()
        state.update(loop=loop, client=client)  # (a stop during calibration: `close` ends it and its requests)
        if policy is not None:  # each budget's time, before the first requests pay to learn it
            await loop.call(lambda: calibrate(sched, policy, info.vocab_size, batch_sizes=calibration_sizes,
                                              should_stop=lambda: loop.stopping))
        servicer.engine, servicer.loop, servicer.metrics = engine, loop, metrics
        servicer.num_running = lambda: len(sched.running)
        servicer.max_context, servicer.vocab_size, servicer.target_name = max_context, info.vocab_size, info.model
        if colocated is None:  # a remote target: the draft is ready while it answers and fits (`TargetWatch`)
            state["watch"] = TargetWatch(client, misfit)
            client.on_unreachable = state["watch"].nudge
            servicer.target_misfit = lambda: state["watch"].misfit
        return (f"model {args.model} ({engine.model.cfg.architecture}, steps {spec.num_steps} topk {spec.topk} "
                f"draft tokens {spec.num_draft_tokens}, speculation {args.speculation}) for target {info.model} "
                f"at {args.target}")

    async def watch(set_ready) -> None:
        if "watch" in state:
            await state["watch"].run(set_ready)

    async def close() -> None:
        if "loop" in state:
            if await asyncio.to_thread(state["loop"].stop):
                if "watch" in state:  # a remote target: what this draft still holds there is freed now
                    await asyncio.to_thread(_release_held, state["loop"].scheduler, state["client"])
                state["client"].close()
            else:  # (QA: closed under a step in flight, the channel failed it with a traceback; the process exits next)
                log.warning("the draft's engine thread is still in a step after 5 s; its target channel is left open")
            write_history(state["loop"].scheduler.policy)
        if "colocated" in state:  # after the draft's loop: its thread may be in a target call until then
            await asyncio.to_thread(state["colocated"].stop)

    servicers = [lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, s)]
    parent_required: tuple[str, ...] = (f"/{HEALTH_NAME}/GetModelInfo",)
    hosted = dict(more_health_names=(LIVENESS,), watch=watch)
    if colocated is not None:
        servicers.append(colocated.add_to)
        parent_required += colocated.per_step_methods
        hosted = dict(more_health_names=(LIVENESS, colocated.health_name),
                      still_served=frozenset(colocated.per_step_methods), busy=colocated.busy)
    await run_service(ServiceSpec(
        name="draft", health_name=HEALTH_NAME, servicers=servicers,
        load=load, close=close, host=args.host, port=args.port, tls=TlsConfig.from_args(args),
        metrics_port=args.metrics_port, drain_s=args.drain_seconds, model_name=model_label(args.model),
        trace_parent_required=parent_required, engine_busy=engine_busy, engine_which=stalled_thread,
        stall_s=args.engine_stall_seconds,
        **hosted,
    ), shutdown, ready)


def _release_held(sched, client) -> None:
    """Once the engine thread has stopped: release on the target the requests the scheduler still runs (streams a
    drain cut whose aborts came after the thread's last round), with the ones left pending, in one short call, so
    the target's own drain need not wait them out (QA: `specdec up` stopped the target 30 s after the draft)."""
    held = list(sched.running)
    if held:
        client.release_later(held)
    if client.release_pending(timeout_s=1.0):
        log.info("released what this draft held on its target as it stopped")


def _release_pending(client, watch) -> None:
    """The draft engine's chore: once its target watch has seen the target answer, release the requests that
    ended while it was away (`draft_service.pending_release`)."""
    if watch is not None and watch.down is None:
        client.release_pending()  # (nothing pending: no call)


def calibration_max_batch(args, opts) -> int:
    """`--calibration-max-batch`, by default the max batch size on a GPU (its start-up has seconds to spare: graph
    capture takes longer) and 1 on a CPU (the README's first command starts a stack for one request); at most the
    max batch size (said when it cuts a value given)."""
    given = args.calibration_max_batch
    if given is None:
        return opts.max_batch_size if str(opts.device).startswith("cuda") else 1
    if args.speculation != "auto":
        log.warning("--calibration-max-batch %d: no calibration with --speculation %s (only auto has budgets to "
                    "time)", given, args.speculation)
    if given > opts.max_batch_size:
        log.info("--calibration-max-batch %d: calibrating up to --max-batch-size %d", given, opts.max_batch_size)
    return min(given, opts.max_batch_size)


def write_history(policy) -> None:
    """Diagnosis: `--speculation auto`'s every record and the admissions (`SpeculationPolicy.history`) as JSON
    lines to the file named by SPECDEC_POLICY_HISTORY, at shutdown."""
    path = os.environ.get(HISTORY_ENV)
    if policy is None or policy.history is None or not path:
        return
    with open(path, "w") as out:
        for entry in policy.history:
            out.write(json.dumps(entry) + "\n")
    log.info("wrote %d policy records to %s", len(policy.history), path)


def feature_row_bytes(client: TargetClient, engine) -> int:
    """Bytes of one token's features on the wire: the target's compute dtype (taken to be the draft's), or 8-bit
    floats plus a float32 scale (`--feature-wire fp8`)."""
    if client.feature_wire == FP8_ROWS:
        return client.feature_dim + 4
    return client.feature_dim * engine.dtype.itemsize


class StepPhases:
    """Where the draft's steps go, as `step_phase_seconds{phase}` observations: after each engine-loop step, the
    growth of the scheduler's cumulative timings by phase (with two-batch overlap a loop step lands one
    micro-batch and launches the next, so a phase's observation may cover parts of two micro-steps)."""

    PHASES = {"propose": "propose_s", "verify": "verify_s", "extend": "extend_s", "admit": "admit_s"}

    def __init__(self, timings: StepTimings):
        self.timings = timings
        self.last = self._read()

    def _read(self) -> dict[str, float]:
        t = self.timings
        read = {phase: getattr(t, name) for phase, name in self.PHASES.items()}
        read["step"] = t.plain_s + t.spec_s
        return read

    def observe(self, metrics) -> None:
        now = self._read()
        for phase, total in now.items():
            if total > self.last[phase]:
                metrics.observe_phase(phase, total - self.last[phase])
        self.last = now


def _observe(metrics, engine, events) -> None:
    """Spec-decode counters of one step (KV and request gauges are read at scrape time, see `track`). Only
    requests that had a draft count as drafts: under `--speculation auto` a step may verify nothing (plain) or
    part of the tree."""
    verified = [e for e in events if e.from_verify]
    if verified:
        metrics.observe_batch(len(verified))
    drafted = [e for e in verified if e.num_draft_tokens]
    if drafted:
        per_pos = [0] * engine.spec.num_steps
        for e in drafted:
            for i in range(min(e.num_accepted_drafts, len(per_pos))):
                per_pos[i] += 1
        metrics.observe_spec_step(len(drafted), sum(e.num_draft_tokens for e in drafted), per_pos)
