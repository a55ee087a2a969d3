"""One request's token stream over its pair, continuing elsewhere when a service fails under it.

The request starts on its pair's draft (speculative) or, without speculation or with the draft down, on the
pair's target. When the draft fails (down, broken stream, an error status) the request continues on
the same pair's target with plain `Generate` over `prompt + tokens already produced` and the remaining token
budget; when the target fails, it continues the same way on another pair, through that pair's draft when it has
one. While no pair is up (a new request, or one whose only pair failed) the request waits for one, up to the
gateway's `--pair-wait-seconds` within the client's deadline: a pair back from a restart will do. The caller sees
one stream of token deltas. Greedy decoding is deterministic, so the text is exactly what an uninterrupted run
gives; sampled requests keep the target's distribution but not the same sample.

Each attempt uses its own downstream request id (`rid`, `rid~1`, `rid~2`, ...), since the failed service may
still hold the old one, and skips the ids other streams of the gateway hold (`gateway.downstream_ids`: clients
may send one id for several requests at once). An id another request runs under all the same (ALREADY_EXISTS:
another gateway's stream, a client's own `rid~1`) is sent again under a random suffix (`rid~<8 hex>`),
`MAX_ID_TRIES` times at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from gateway.downstream import Chunk, Finish, StreamBroken, is_backend_failure
from gateway.downstream_ids import DownstreamIds
from gateway.router import Lease, Part, Router
from specdec.errors import TARGET_PREFIX
from specdec.sampling_params import SamplingParams
from specdec.spec_params import asked_tree_shape, fits
from specdec.telemetry import get_tracer
from specdec.v1 import common_pb2

log = logging.getLogger(__name__)

FINISH_STOP = common_pb2.FINISH_REASON_STOP
FINISH_LENGTH = common_pb2.FINISH_REASON_LENGTH
FINISH_ABORT = common_pb2.FINISH_REASON_ABORT
MAX_ID_TRIES = 8  # ids tried past ones another request runs under (ALREADY_EXISTS)
WAIT_WORTH_SAYING_S = 0.01  # a wait for a pair this long or longer gets a span event and a log line


@dataclass(frozen=True)
class GenerationPlan:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    speculative: bool  # the client allows speculation
    finish_token_ids: frozenset[int]  # a generated token in here ends the request (eos unless ignore_eos, stops)
    spec: common_pb2.SpecParams | None = None


class FallbackGeneration:
    """`async for chunk in FallbackGeneration(router, plan, timeout).run()`; then read the summary fields."""

    def __init__(self, router: Router, plan: GenerationPlan, timeout_s: Callable[[], float | None],
                 pair_wait_s: float = 0.0, ids: DownstreamIds | None = None) -> None:
        self._router = router
        self._plan = plan
        self._ids = DownstreamIds() if ids is None else ids  # the gateway's: ids its other streams hold
        self._claimed: list[str] = []  # the downstream ids this stream took, held until it ends
        self._ended = False
        self._timeout_s = timeout_s  # seconds left on the client's deadline, asked before each attempt
        self._pair_wait_s = pair_wait_s  # how long the request waits for a pair when none is up (`_wait_s`)
        self.generated: list[int] = []
        self.num_fallbacks = 0
        self.speculative = plan.speculative  # false once any part of the stream came from a plain Generate
        # Release calls on their way -> the id each releases (held until it lands, the stream's end or not)
        self._releasing: dict[asyncio.Task, str] = {}
        self._asked = asked_tree_shape(plan.spec) if plan.spec is not None else {}  # its own tree shape, if any

    async def run(self) -> AsyncIterator[Chunk]:
        with get_tracer().start_as_current_span("gateway.route") as span:
            lease = await self._waited(self._router.acquire_waiting(self._plan.speculative, self._wait_s(),
                                                                    fit=self._fits))
            span.set_attribute("specdec.pair", str(lease.pair))
            span.set_attribute("speculative", self._plan.speculative and self._drafts(lease.pair))
        failure: Exception | None = None
        try:
            use_draft = self._plan.speculative and self._drafts(lease.pair)
            # attempts that fail in a row, no token between them; a stream that made progress since its last
            # failure starts the count over (QA: a long stream died on its third separate fault, 12 s apart, with
            # a healthy pair up, when the bound counted its whole life)
            most_in_a_row = 2 * len(self._router.pairs) + 1
            in_a_row, produced = 0, 0
            number, taken = 0, 0  # the downstream id's suffix; ids found taken downstream (ALREADY_EXISTS)
            while True:
                done = self._finished_locally()
                if done is not None:
                    yield Chunk((), done)
                    return
                self.speculative = self.speculative and use_draft
                while True:
                    if taken:  # another gateway's stream has it: a suffix of this stream's own, not the next one
                        rid = self._ids.claim_unique(self._plan.request_id)  # (which that gateway takes next too)
                    else:
                        rid, number = self._ids.claim(self._plan.request_id, number)
                        number += 1
                    self._claimed.append(rid)
                    try:
                        async for chunk in self._attempt(lease, rid, use_draft):
                            yield chunk
                        return
                    except grpc.aio.AioRpcError as exc:
                        if not (exc.code() == grpc.StatusCode.ALREADY_EXISTS and taken < MAX_ID_TRIES):
                            failure = exc
                            break
                        taken += 1
                        log.info("id %s is another request's on %s; sending this stream under a suffix of its own",
                                 rid, lease.pair)
                    except Exception as exc:
                        failure = exc
                        break
                if not is_backend_failure(failure):
                    raise failure
                in_a_row = 1 if len(self.generated) > produced else in_a_row + 1
                produced = len(self.generated)
                if in_a_row >= most_in_a_row:
                    raise StreamBroken(f"request {self._plan.request_id} failed on {in_a_row} attempts in a row "
                                       f"with no token between them; the last: {_describe(failure)}")
                lease, use_draft = await self._recover(lease, rid, use_draft, failure)
        finally:
            failure = None  # raised from this frame, it would hold the frame through its traceback (a cycle)
            self._router.release(lease)
            self._ended = True
            self._ids.release(set(self._claimed) - set(self._releasing.values()))

    async def _attempt(self, lease: Lease, rid: str, use_draft: bool) -> AsyncIterator[Chunk]:
        pair = lease.pair
        prompt = (*self._plan.prompt_ids, *self.generated)
        sampling = dataclasses.replace(
            self._plan.sampling, max_new_tokens=self._plan.sampling.max_new_tokens - len(self.generated)
        )
        # the parts this stream waits on: a frozen one (health checks unanswered) is left, not waited out
        parts = (Part.DRAFT, Part.TARGET) if use_draft else (Part.TARGET,)
        hung = {part: pair.unresponsive[part] for part in parts}
        if use_draft:
            stream = pair.draft.generate(rid, prompt, sampling, self._timeout_s(), self._plan.spec)
        else:
            stream = pair.target.generate(rid, prompt, sampling, self._timeout_s())
        async with contextlib.aclosing(stream):
            async for chunk in _unless_hung(stream, hung):
                if chunk.finish is not None and chunk.finish.reason == FINISH_ABORT:
                    # an Abort call on the service named this request (an operator's; a failing service ends a
                    # stream with an error status instead): the request ends there, and the part stays in
                    log.info("request %s was aborted on %s (an Abort call); its stream ends", rid, pair)
                self.generated.extend(chunk.token_ids)
                yield chunk
                if chunk.finish is not None:
                    return
        raise StreamBroken(f"{pair}: the stream ended without a finish")

    async def _recover(self, lease: Lease, rid: str, used_draft: bool, exc: Exception) -> tuple[Lease, bool]:
        """Mark what failed and say where the request continues: (lease, use_draft). Off a failed target the request
        goes to another pair, through its draft when it has one; with none up it waits for one (`_wait_s`: the
        failed pair back after a restart will do). May raise NotReady."""
        self.num_fallbacks += 1
        self.speculative = False  # the final stats of a stream with a fallback say so (tau 0: gateway.proto)
        reason = _describe(exc)
        if isinstance(exc, PartHung) and exc.part is Part.TARGET:
            used_draft = False  # the pair's target froze under its draft: the request moves to another pair
        elif used_draft and (_target_failed_under(exc) or _one_process_gone(lease, exc)):
            # the draft says its target failed it (stalled, away, a malformed reply): going on on that target would
            # fail again (QA: two fallbacks for one stalled target, and the healthy draft taken out), so the request
            # moves to another pair, and the draft, which reports its own readiness, stays in
            self._release_later(lease, rid)
            used_draft = False
        trace.get_current_span().add_event("specdec.fallback", {
            "specdec.failed_part": Part.DRAFT.value if used_draft else Part.TARGET.value,
            "specdec.pair": str(lease.pair), "specdec.reason": reason[:200]})
        if used_draft:
            self._router.report_failure(lease.pair, Part.DRAFT, reason)
            self._release_later(lease, rid)  # the target may still hold the draft's request
            log.warning("draft of %s failed (%s); continuing on its target", lease.pair, reason)
            return lease, False
        self._router.report_failure(lease.pair, Part.TARGET, reason)
        new_lease = await self._waited(self._router.switch(lease, self._plan.speculative, self._wait_s(),
                                                           fit=self._fits))
        use_draft = self._plan.speculative and self._drafts(new_lease.pair)
        log.warning("%s of %s failed (%s); continuing on %s%s", "process" if _one_process(lease.pair) else "target",
                    lease.pair, reason, new_lease.pair, " through its draft" if use_draft else "")
        return new_lease, use_draft

    @staticmethod
    async def _waited(acquiring) -> Lease:
        """The lease `acquiring` gets; a wait for a pair to come up is said on the current span (an event in the
        request's trace, Jaeger) and in the log."""
        t0 = time.monotonic()
        lease = await acquiring
        waited = time.monotonic() - t0
        if waited >= WAIT_WORTH_SAYING_S:
            trace.get_current_span().add_event("specdec.waited_for_pair", {
                "specdec.wait_s": round(waited, 3), "specdec.pair": str(lease.pair)})
            log.info("waited %.1f s for a pair to come up; going on on %s", waited, lease.pair)
        return lease

    def _wait_s(self) -> float:
        """How long to wait for a pair when none is up: the gateway's `--pair-wait-seconds`, within the client's
        deadline."""
        left = self._timeout_s()
        return self._pair_wait_s if left is None else max(0.0, min(self._pair_wait_s, left))

    def _fits(self, pair) -> bool:
        """Does the request fit the pair's draft: its own tree shape (`spec`), and its context so far within the
        draft's (a draft started with a smaller --max-context than its target's)? (Unknown: the draft checks.)
        Behind one gateway, pairs of different shapes each take the specs that fit them; a pair whose draft
        does not fit serves the request plainly (the same text) rather than refusing it. Before, a prompt the
        target's context held but the draft's did not was refused INVALID_ARGUMENT (QA)."""
        context = len(self._plan.prompt_ids) + len(self.generated)
        fits_context = not pair.draft_max_context_len or context < pair.draft_max_context_len
        return fits_context and fits(self._asked, pair.draft_shape)

    def _drafts(self, pair) -> bool:
        return pair.speculative and self._fits(pair)

    def _finished_locally(self) -> Finish | None:
        """A request whose last stream broke right after its finishing token needs no further call."""
        if self.generated and self.generated[-1] in self._plan.finish_token_ids:
            return Finish(FINISH_STOP)
        if len(self.generated) >= self._plan.sampling.max_new_tokens:
            return Finish(FINISH_LENGTH)
        return None

    def _release_later(self, lease: Lease, rid: str) -> None:
        """Release `rid` on the pair's target in the background; the id stays this stream's until that lands (a
        stream taking it meanwhile would have its own request released by it)."""
        task = asyncio.create_task(lease.pair.target.release([rid]))
        self._releasing[task] = rid

        def landed(done: asyncio.Task) -> None:
            del self._releasing[done]
            if self._ended:
                self._ids.release([rid])

        task.add_done_callback(landed)


class PartHung(StreamBroken):
    """A part a stream runs on stopped answering health checks (frozen, or cut off) or answered that its engine is
    stalled (UNKNOWN): the stream left it."""

    def __init__(self, part: Part) -> None:
        super().__init__(f"the {part.value} stopped answering health checks or said its engine stalled")
        self.part = part


async def _unless_hung(stream: AsyncIterator[Chunk], hung: dict[Part, asyncio.Event]) -> AsyncIterator[Chunk]:
    """`stream`'s chunks until one of the `hung` events is set (the part's health checks went unanswered): then
    the read in progress is cancelled (the downstream call with it) and PartHung raised. Without it a stream on a
    frozen draft waited for as long as the freeze (45 s+ in a QA run, with no client deadline) although the
    gateway had marked the draft down 3.5 s in, and one on a frozen target for the draft's 60 s call timeout.

    One watcher task per event, none per chunk (racing each read against the events cost 13 us a chunk): a
    watcher that fires while the stream's task waits in a read cancels that task, and the cancel is taken back
    (`uncancel`) and turned into PartHung here; one that fires between reads is seen before the next read. A
    cancel from elsewhere (the client left) stays a cancel."""
    task = asyncio.current_task()
    reading, gone = False, None  # gone: the first part found hung

    def fire(part: Part) -> None:
        nonlocal gone
        if gone is None:
            gone = part
            if reading:  # the task waits inside `anext` below: nothing else of it runs meanwhile
                task.cancel()

    watchers = [asyncio.ensure_future(_when_set(event, part, fire)) for part, event in hung.items()]
    try:
        while True:
            if gone is not None:
                raise PartHung(gone)
            reading = True
            try:
                chunk = await anext(stream)
            except StopAsyncIteration:
                return
            except asyncio.CancelledError:
                if gone is not None and task.uncancel() == 0:  # our cancel, and no other pending
                    raise PartHung(gone) from None
                raise
            finally:
                reading = False
            yield chunk
    finally:
        for watcher in watchers:
            watcher.cancel()


async def _when_set(event: asyncio.Event, part: Part, fire) -> None:
    await event.wait()
    fire(part)


def _target_failed_under(exc: Exception) -> bool:
    """A draft's failure that names its target as the cause (`TARGET_PREFIX`, `draft_service.target_client`)."""
    details = getattr(exc, "details", None)
    return callable(details) and (details() or "").startswith(TARGET_PREFIX)


def _one_process(pair) -> bool:
    """Draft and target at one address: one process serves both (`serve-draft --target in-process`)."""
    return pair.draft is not None and pair.draft.addr == pair.target.addr


def _one_process_gone(lease: Lease, exc: Exception) -> bool:
    """A colocated pair (draft and target at one address: `serve-draft --target in-process`) whose draft stream was
    cut (UNAVAILABLE, or a stream without its finish): the process serving both is gone or going, so its target
    would fail the continuation too (two fallbacks for one death, before)."""
    if not _one_process(lease.pair):
        return False
    code = getattr(exc, "code", None)
    return isinstance(exc, StreamBroken) or (callable(code) and code() == grpc.StatusCode.UNAVAILABLE)


def _describe(exc: Exception) -> str:
    code = getattr(exc, "code", None)
    if callable(code):
        return f"{code().name}: {exc.details()}"
    return str(exc)
