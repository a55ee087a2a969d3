"""TargetService over gRPC: protobuf in, engine calls on the engine thread, protobuf out."""

from __future__ import annotations

import asyncio
import logging
import time

from opentelemetry import trace

from specdec.engine.admission import MAX_PREFILL_TOKENS
from specdec.engine.plain_steps import check_plain_steps
from specdec.engine.requests import RUNNING
from specdec.engine.target_engine import TargetEngine
from specdec.errors import InvalidInput, SpecdecError
from specdec.request_ids import is_warmup
from specdec.rpc.errors import map_servicer_errors
from specdec.rpc.kv_stats import kv_stats
from specdec.rpc.sampling_codec import sampling_from_proto
from specdec.rpc.target_codec import (
    check_request_id,
    features_to_host,
    finish_to_proto,
    prefill_from_proto,
    prefill_reply_bytes,
    verify_from_proto,
    verify_reply_bytes,
)
from specdec.rpc.tensor_codec import FP8_ROWS
from specdec.serving.engine_loop import EngineLoop
from specdec.telemetry import bind_request_id, get_tracer
from specdec.telemetry.tracing import batch_parent, current_trace_context
from specdec.v1 import target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)


def _in_order(groups: list) -> list[list[int]]:
    """The groups (Verify RPCs, in arrival order) cut into consecutive segments whose groups name disjoint request
    ids: a segment's groups may share engine calls, and the segments run one after another."""
    segments: list[list[int]] = []
    seen: set[str] = set()
    for i, g in enumerate(groups):
        ids = {inp.request_id for inp in g[0]}
        if not segments or ids & seen:
            segments.append([])
            seen = set()
        segments[-1].append(i)
        seen |= ids
    return segments


def _together_or_alone(run, parts: list[list]) -> list:
    """`run` (an engine call that commits all or nothing) over every part's items at once; if it is refused, each
    part alone. -> per part its slice of the outputs, or the SpecdecError that refused it (a bad request fails alone,
    and nothing runs twice: what a refused call named committed nothing)."""
    try:
        outs = run([item for part in parts for item in part])
    except SpecdecError as exc:
        if len(parts) == 1:
            return [exc]
        answers = []
        for part in parts:
            try:
                answers.append(run(part))
            except SpecdecError as alone:
                answers.append(alone)
        return answers
    answers, start = [], 0
    for part in parts:
        answers.append(outs[start : start + len(part)])
        start += len(part)
    return answers


def _warmup(inputs: list) -> bool:
    """A draft's start-up warm-up (`specdec.engine.warmup`): served, but not the traffic the metrics describe."""
    return all(is_warmup(inp.request_id) for inp in inputs)


@map_servicer_errors
class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, engine: TargetEngine, loop: EngineLoop, model_name: str, metrics=None):
        self.engine, self.loop, self.model_name, self.metrics = engine, loop, model_name, metrics
        self.verify_lane_port = 0  # where its verify lane listens (`--verify-lane-port`), told in GetModelInfo
        # prompts prefilled in parts take turns, a part each: one part is queued at a time, so a round of the engine
        # thread runs at most one (four long prompts admitted together once put four parts in a round: 2 s on a
        # 2-core CPU, past a 2 s --engine-stall-seconds; QA)
        self._part_turn = asyncio.Lock()

    async def Prefill(self, request, context):
        self.engine.check_prompt_length(len(request.prompt_ids))  # before the ids are read (QA: 10 s for 1e8)
        inp = prefill_from_proto(request)
        with bind_request_id(inp.request_id):
            t0 = time.perf_counter()
            if self.engine.in_parts(inp):
                out = await self._prefill_in_parts(inp)
            else:
                out = await self.loop.call_batched(self._prefill_many, inp, len(inp.prompt_ids), self._prefill_cap())
            elapsed = time.perf_counter() - t0
            trace.get_current_span().set_attribute("num_prompt_tokens", len(inp.prompt_ids))
            # a draft's start-up requests (warm-up, calibration: 382 lines for one calibrating up to 64) at DEBUG
            level = logging.DEBUG if is_warmup(inp.request_id) else logging.INFO
            log.log(level, "prefill: %d prompt tokens in %.3f s", len(inp.prompt_ids), elapsed,
                    extra={"prompt_tokens": len(inp.prompt_ids), "prefill_s": round(elapsed, 4)})
            return prefill_reply_bytes(out)  # encoded here: see specdec.rpc.wire

    async def _prefill_in_parts(self, inp):
        """A prompt longer than `prefill_chunk_tokens`: admitted, then one engine call per part
        (`specdec.engine.prefill_parts`). Each part's call joins the loop's queue behind the calls that came
        meanwhile, so the Verify calls of running streams run between two parts; several such prompts take turns, a
        part each (`_part_turn`). A caller that leaves (a draft cancelling the Prefill of a request whose client
        left) stops it after the part under way: the request is released, its pages freed, also when that part was
        its last (before, a caller that left during the last part left the request running until its idle time ran
        out, its pages held: QA)."""
        packed = {inp.request_id} if inp.feature_wire == FP8_ROWS else set()
        admitted = None
        try:
            admitted = await self.loop.call(self.engine.begin_prefill, inp)
            out = None
            while out is None:
                async with self._part_turn:
                    out = await self.loop.call(self._prefill_part, inp.request_id, packed)
            return out
        except BaseException:
            await asyncio.shield(self.loop.call(self._drop_parts, inp, admitted))
            raise

    def _prefill_part(self, request_id: str, packed: set):
        out = self.engine.prefill_part(request_id)
        return None if out is None else features_to_host([out], packed)[0]

    def _drop_parts(self, inp, admitted) -> None:
        """Release the request `_prefill_in_parts` admitted for `inp` (`admitted`, None when its caller left while
        it was being admitted): still being prefilled, or prefilled by its last part. Not one refused at admission,
        nor one a failed part released already, nor a later request under the id."""
        rid = inp.request_id
        part = self.engine.prefilling.get(rid)
        if admitted is None and part is not None and part.inp is inp:  # it left while its admission ran
            admitted = self.engine.requests.get(rid)
        if admitted is not None and self.engine.requests.get(rid) is admitted:
            self.engine.release(rid)

    async def Verify(self, request, context):
        self.engine.check_verify_size(len(request.trees))  # before the trees are read, on this event loop
        inputs, plain_steps, feature_rows = verify_from_proto(request)
        if not inputs:
            return target_pb2.VerifyResponse()
        check_plain_steps(inputs, plain_steps, feature_rows)  # a bad count fails this RPC alone, not its batch
        outputs = await self.loop.call_batched(
            self._verify_many, (inputs, current_trace_context(), time.perf_counter(), (plain_steps, feature_rows)))
        t0 = time.perf_counter()
        reply = verify_reply_bytes(outputs)  # encoded here: see specdec.rpc.wire
        if not _warmup(inputs):
            self._phase("reply", time.perf_counter() - t0)
        return reply

    def _phase(self, phase: str, seconds: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_phase(phase, seconds)

    def _prefill_cap(self) -> int:
        """The most prompt tokens of one round's Prefill RPCs (`EngineLoop.call_batched`'s cap): one part
        (`prefill_chunk_tokens`), so that a burst of short prompts, from one draft or many, stops the Verify calls of
        running streams for one part at most, as a long prompt's parts do; MAX_PREFILL_TOKENS with parts off."""
        return min(self.engine.prefill_chunk_tokens or MAX_PREFILL_TOKENS, MAX_PREFILL_TOKENS)

    def _prefill_many(self, inputs: list) -> list:
        """Prefill RPCs that arrived together run as one forward (engine thread; at most `_prefill_cap` prompt
        tokens, or one prompt). If it is refused, each runs alone, so a bad request (a duplicate id, no KV pages)
        fails alone; its result is then its exception."""
        packed = {inp.request_id for inp in inputs if inp.feature_wire == FP8_ROWS}
        run = lambda part: features_to_host(self.engine.prefill(part), packed)  # noqa: E731
        answers = _together_or_alone(run, [[inp] for inp in inputs])
        return [a if isinstance(a, SpecdecError) else a[0] for a in answers]

    def _verify_many(self, groups: list[tuple[list, object, float, tuple[int, int]]]) -> list[list]:
        """Several Verify RPCs that arrived together run as one forward (engine thread), or one per (plain steps,
        feature rows) when they ask for different ones. Each group is (inputs, the RPC's trace context or None,
        when the RPC was queued, (plain steps, feature rows)). A group naming a request that an earlier group of
        the batch names (a draft's next plain call, sent before the previous one's reply) runs after it: the
        groups are cut into segments that run one after another (`_in_order`), and each segment is one
        `target.verify_batch` span (parented to its first traced RPC, linked to the others), one `batch_size`
        and one `forward` observation (two pipelined calls of one request were one forward of 2 before, QA).

        A refused group fails alone and never makes another group run twice: a shared engine call that is refused
        (it commits nothing) runs again one group at a time, and groups that already ran keep their outputs (the
        engine loop's own retry of a failed batch would run them again on the tokens they committed)."""
        counted = self.metrics is not None and not _warmup([inp for g in groups for inp in g[0]])
        result: list = [self._one_width(g[0]) for g in groups]  # a refused RPC runs nothing
        for segment in _in_order(groups):
            segment = [i for i in segment if result[i] is None]
            if not segment:
                continue
            started = time.perf_counter()
            members = [groups[i] for i in segment]
            flat = [inp for g in members for inp in g[0]]
            if counted:
                for _, _, queued, _ in members:
                    self.metrics.observe_phase("queue", started - queued)
            parent, links = batch_parent([g[1] for g in members])
            if parent is None:
                self._verify_segment(groups, segment, result)
            else:
                attributes = {"batch_size": len(flat), "num_rpcs": len(members),
                              "num_draft_tokens": sum(len(i.draft_tokens) for i in flat),
                              "plain_steps": max(g[3][0] for g in members),
                              "feature_rows": max(g[3][1] for g in members)}
                with get_tracer().start_as_current_span("target.verify_batch", parent, links=links,
                                                        attributes=attributes):
                    self._verify_segment(groups, segment, result)
            ran = sum(len(groups[i][0]) for i in segment if not isinstance(result[i], SpecdecError))
            if counted and ran:  # what ran: a refused call (200 000 trees of an unknown id) is no batch (QA)
                self.metrics.observe_batch(ran)
                self._phase("forward", time.perf_counter() - started)
        return result

    def _verify_segment(self, groups: list, segment: list[int], result: list) -> None:
        for kind in dict.fromkeys(groups[i][3] for i in segment):
            members = [i for i in segment if groups[i][3] == kind]
            run = lambda inputs, kind=kind: self._verify_kind(inputs, kind)  # noqa: E731
            for i, answer in zip(members, _together_or_alone(run, [groups[i][0] for i in members]), strict=True):
                result[i] = answer

    def _verify_kind(self, inputs: list, kind: tuple[int, int]) -> list:
        steps, rows = kind
        self._not_generate(inputs)
        packed = self._packed(inputs)  # before the call: a request it finishes leaves the engine
        # a tree verify's features come to the host beside its logits (`engine.host_features`), 8-bit ones after
        outs = self.engine.verify(inputs, plain_steps=steps, feature_rows=rows, features_on_host=not packed)
        features_to_host(outs, packed)  # here, not in the handler: the copy waits for the GPU
        return outs

    def _one_width(self, inputs: list) -> InvalidInput | None:
        """Why one Verify RPC cannot be answered, or None: its reply carries one feature tensor, so the requests it
        names that get features must read the same number of layers (QA: mixed ones failed INTERNAL after the
        tokens were committed). RPCs of different widths still share a forward (an EAGLE-1 and an EAGLE-3 draft)."""
        widths: dict[int, str] = {}
        for inp in inputs:
            req = self.engine.requests.get(inp.request_id)
            if req is not None and req.features:
                widths.setdefault(max(1, len(req.feature_layers)), inp.request_id)
        if len(widths) < 2:
            return None
        first, second = list(widths.values())[:2]
        return InvalidInput(f"requests {first!r} and {second!r} read the features of different layers: one Verify "
                            "returns features of one width; verify them in separate calls")

    def _streams(self, ids) -> list[str]:
        """Those of `ids` that are this target's own Generate streams, running or waiting (engine thread)."""
        scheduler = self.loop.scheduler
        if scheduler is None:  # (an engine loop without Generate streams)
            return []
        waiting = {s.request_id for s in scheduler.waiting} if scheduler.waiting else set()
        return [rid for rid in ids if rid in scheduler.running or rid in waiting]

    def _not_generate(self, inputs: list) -> None:
        """Verify names a draft's requests: one of this target's Generate streams is refused (another client's
        Verify took tokens from it, and its next step then failed with every stream of its batch: QA)."""
        own = self._streams(inp.request_id for inp in inputs)
        if own:
            raise InvalidInput(f"request {own[0]!r} is a Generate stream of this target: Verify and Release name the "
                               "requests a draft prefilled")

    def _packed(self, inputs: list) -> frozenset:
        """The ids whose features travel as 8-bit floats: all of a Verify batch's when they all asked for it
        (the reply carries one blob), else none."""
        reqs = [self.engine.requests.get(inp.request_id) for inp in inputs]
        reqs = [r for r in reqs if r is not None]  # not the finished ones a plain call may name (no features)
        if reqs and all(r.feature_wire == FP8_ROWS for r in reqs):
            return frozenset(inp.request_id for inp in inputs)
        return frozenset()

    async def Release(self, request, context):
        ids = [check_request_id(r) for r in request.request_ids]
        released = await self.loop.call(self._release, ids)
        return target_pb2.ReleaseResponse(num_released=released)

    def _release(self, ids: list[str]) -> int:
        """Idempotent: ids the target no longer holds (finished, or never seen) and its own Generate streams are
        skipped; one waiting for pages leaves the page queue (not counted: it held none)."""
        n = 0
        own = set(self._streams(ids))  # its caller ends it by leaving (`_not_generate`)
        for rid in ids:
            if rid in own:
                continue
            held = rid in self.engine.requests
            if held or rid in self.engine.page_queue:
                self.engine.release(rid)
            n += held
        return n

    async def Generate(self, request, context):
        """Plain decoding (no speculation): the fallback and the baseline."""
        rid = check_request_id(request.request_id, chosen_by_client=True)
        sampling = sampling_from_proto(request.sampling if request.HasField("sampling") else None)
        prompt = list(request.prompt_ids)
        await self.loop.call(self._validate, prompt, sampling)
        with bind_request_id(rid):
            t0, n = time.perf_counter(), 0
            async for ev in self.loop.stream(rid, prompt, sampling):
                n += len(ev.tokens)
                msg = target_pb2.TargetServiceGenerateResponse(token_ids=ev.tokens)
                if ev.finish_reason != RUNNING:
                    msg.finish_reason = finish_to_proto(ev.finish_reason)
                    msg.prompt_tokens, msg.completion_tokens = len(prompt), n
                    log.info("generate done: %d prompt + %d new tokens in %.3f s (%s)", len(prompt), n,
                             time.perf_counter() - t0, ev.finish_reason)
                yield msg

    def _validate(self, prompt, sampling) -> None:
        self.engine.validate_prompt(prompt)
        sampling.validate(self.engine.cfg.vocab_size)

    async def GetModelInfo(self, request, context):
        info = model_info(self.engine, self.model_name)
        info.verify_lane_port = self.verify_lane_port
        return info


def model_info(engine: TargetEngine, model_name: str) -> target_pb2.TargetServiceGetModelInfoResponse:
    """What GetModelInfo answers (also what a draft with an in-process target reads: `draft_service.colocated`)."""
    cfg = engine.cfg
    return target_pb2.TargetServiceGetModelInfoResponse(
        model=model_name, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, max_context_len=engine.max_context,
        eos_token_ids=list(cfg.eos_token_ids), dtype=str(engine.kv.k.dtype).replace("torch.", ""),
        device=str(engine.device),
        kv=kv_stats(engine.kv), num_running=len(engine.requests),
        max_draft_tokens=engine.max_draft_tokens,
        num_waiting_for_pages=len(engine.page_queue),
        prefill_chunk_tokens=engine.prefill_chunk_tokens,
    )
