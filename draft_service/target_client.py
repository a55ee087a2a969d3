"""A blocking TargetService client for the draft's engine thread: engine dataclasses in and out, gRPC errors
turned back into the engine's exceptions (so the scheduler handles a remote target like a local one)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
from google.protobuf.message import DecodeError

from draft_service.pending_release import PendingReleases
from draft_service.verify_lane import VerifyLane
from specdec.engine.requests import PrefillInput, PrefillOutput, VerifyInput, VerifyOutput, kept_feature_rows
from specdec.errors import (
    TARGET_PREFIX,
    Cancelled,
    ConfigError,
    DuplicateRequest,
    InvalidInput,
    NotReady,
    OutOfOrder,
    OutOfPages,
    SpecdecError,
    UnknownRequest,
)
from specdec.rpc.options import channel_options
from specdec.rpc.peer_protocol import not_grpc, not_grpc_text
from specdec.rpc.target_codec import (
    prefill_output_from_proto,
    prefill_to_proto,
    verify_outputs_from_proto,
    verify_to_proto,
)
from specdec.rpc.tls import TlsConfig, handshake_hint
from specdec.rpc.tls_reload import tls_watch
from specdec.rpc.wire import decode_with_tensor
from specdec.telemetry.grpc_tracing import blocking_call_metadata
from specdec.telemetry.tracing import attached
from specdec.v1 import common_pb2, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

TARGET_SERVICE_PATH = "/specdec.v1.TargetService/"  # span name when a stub method does not tell its own
VERIFY_PATH = TARGET_SERVICE_PATH + "Verify"

# the target's errors back as the engine's exceptions, by the status each names (`specdec.errors`); ABORTED was
# missing, so a pipelined plain call that overtook the one before it failed its whole batch as INTERNAL instead of
# being sent again (`TwoBatchOverlap._again`), and the gateway took a healthy draft out of rotation (QA)
_BY_CODE = {grpc.StatusCode[cls.status]: cls
            for cls in (InvalidInput, UnknownRequest, DuplicateRequest, OutOfPages, NotReady, OutOfOrder)}


CALL_GRACE_S = 5.0  # a call still under way this long after its deadline has a stuck thread (`waits_on_target`)
# a call the target did not answer: it is gone, restarting or refused (UNAVAILABLE), or it stopped with the call
# taken and not yet handed to its handler, which a stopping grpc server cancels (CANCELLED: a cancel of the draft's
# own raises FutureCancelledError instead). Before, that CANCELLED read as the request's client having left.
UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED})
_NEVER = object()


class MalformedReply(SpecdecError):
    """The target answered with something the draft cannot use (INTERNAL: not the caller's fault)."""


class NotGrpc(NotReady):
    """The target's address answers, but not in gRPC (another kind of server there): start-up stops at once
    instead of waiting for it (`draft_service.app`); a call that meets it later is UNAVAILABLE like any target
    away."""


def _code(exc: grpc.RpcError) -> grpc.StatusCode:
    return exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN


def _translate(exc: grpc.RpcError, hint: bool = True) -> SpecdecError:
    """`hint`: whether a `Socket closed` may be a TLS handshake refused (not once the target answered over these
    credentials: then it is a target that went away, QA)."""
    code = _code(exc)
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_CODE.get(code, SpecdecError)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED or code in UNREACHABLE:
        cls = NotReady
    if code == grpc.StatusCode.UNIMPLEMENTED:  # a gateway's or a draft's address given as the target's (QA)
        return ConfigError(f"{TARGET_PREFIX}{details}: the address does not serve specdec.v1.TargetService")
    if not_grpc(code, details):
        return NotGrpc(f"{TARGET_PREFIX}{not_grpc_text('the address')} ({details})")
    return cls(f"{TARGET_PREFIX}{details}{handshake_hint(code, details, 'the target', '--target-tls') if hint else ''}")


@dataclass(frozen=True)
class _Link:
    """A channel to the target and its calls, swapped whole (`renew_channel`, `abandon_calls`) so that a call's
    channel and generation are read together."""

    channel: grpc.Channel
    credentials: grpc.ChannelCredentials | None
    generation: int
    prefill: Callable
    verify: Callable
    release: Callable
    model_info: Callable


class TargetClient:
    """Implements the engine-side target interface (`prefill`, `verify`, `release`) over gRPC."""

    concurrent_calls = True  # a gRPC channel takes calls from several threads (two-batch overlap)

    def __init__(self, addr: str, tls: TlsConfig | None = None, timeout_s: float = 60.0, device=None,
                 feature_wire: str = "", features: bool = True):
        self.addr, self.timeout_s, self.device = addr, timeout_s, device
        self._tls_files = tls_watch(tls, f"channel to the target at {addr}") if tls is not None else None
        self._link = self._open(self._tls_files.taken.channel_credentials() if self._tls_files is not None else None)
        # renewed channels and when to close them (their calls' deadline passed), by a later `renew_channel`
        self._retiring: list[tuple[float, grpc.Channel]] = []
        self._abandoned: dict[int, str] = {}  # link generation -> why `abandon_calls` closed it
        self._left_call: dict[int, float] = {}  # thread -> when it last came back from waiting for the target
        # the credentials (None: plaintext) of the latest call the target answered; _NEVER before any
        self._answered_over: object = _NEVER
        self.feature_wire = feature_wire  # asked of every Prefill: "" (compute dtype) or tensor_codec.FP8_ROWS
        self.feature_dim = 0  # set once the draft is built: the feature width it consumes (0: not checked)
        self.features = features  # its requests ask for features (False: `--speculation off`, none come back)
        # the target's GetModelInfo.prefill_chunk_tokens: it prefills a longer prompt in parts, running Verify calls
        # between them, so the draft admits such a prompt while its running batch goes on (`Admission`); 0: never
        self.prefill_chunk_tokens = 0
        # request id -> its Prefill RPC while `prefill_each` waits for it (`cancel_prefill`, from another thread)
        self._admitting: dict[str, grpc.Future] = {}
        self._admitting_lock = threading.Lock()
        # called (from any thread) when a Prefill, Verify or Release did not reach the target: `TargetWatch.nudge`
        self.on_unreachable: Callable[[], None] | None = None
        self.pending = PendingReleases()  # requests that ended while the target was away, released once it is back
        # thread id -> (its calls under way, the latest of their deadlines); each thread writes its own key
        self._calling: dict[int, tuple[int, float]] = {}
        # the target's verify lane, which Verify calls take when it has one (`model_info` tells)
        self.lane = VerifyLane(addr, plaintext=tls is None)

    def _open(self, credentials: grpc.ChannelCredentials | None, generation: int = 0) -> _Link:
        opts = channel_options()
        channel = (grpc.secure_channel(self.addr, credentials, options=opts) if credentials is not None
                   else grpc.insecure_channel(self.addr, options=opts))
        stub = target_pb2_grpc.TargetServiceStub(channel)

        def raw(name: str, request_cls):  # the feature-carrying replies come back as bytes (specdec.rpc.wire)
            return channel.unary_unary(TARGET_SERVICE_PATH + name, request_serializer=request_cls.SerializeToString,
                                       response_deserializer=None, _registered_method=True)

        return _Link(channel, credentials, generation, raw("Prefill", target_pb2.PrefillRequest),
                     raw("Verify", target_pb2.VerifyRequest), stub.Release, stub.GetModelInfo)

    def renew_channel(self) -> None:
        """A new channel when the TLS files changed (a renewed certificate, which the target requires once the old
        one expires); calls already sent finish on the old channel, closed once they must have (`timeout_s`)."""
        now = time.monotonic()
        for _, channel in [r for r in self._retiring if r[0] <= now]:
            channel.close()
        self._retiring = [r for r in self._retiring if r[0] > now]
        material = self._tls_files.changed() if self._tls_files is not None else None
        if material is None:
            return
        old = self._link
        self._retiring.append((now + self.timeout_s + 5.0, old.channel))
        self._link = self._open(material.channel_credentials(), old.generation + 1)

    def abandon_calls(self, why: str) -> None:
        """End every call in flight with NotReady(why) now (any thread): the target watch found the target gone
        while calls still waited for it. A link to the target cut without a reset (a partition, a frozen proxy)
        held every running request until its call's deadline, 60 s (QA); so its requests fail over at once. The
        channel is closed (which ends its calls, blocking ones too) after a new one took its place."""
        old = self._link
        self._abandoned[old.generation] = why
        self._link = self._open(old.credentials, old.generation + 1)
        old.channel.close()
        self.lane.reset()
        # what answers next may be a target restarted with TLS: its refused handshake gets the hint again
        self._answered_over = _NEVER

    def _call(self, method: str, request, timeout_s: float | None = None, watched: bool = True):
        """One blocking call of the link's `method`; under a trace (a sampled step, a request's prefill) it carries
        `traceparent` and gets a CLIENT span (the aio interceptors do not apply to this blocking channel).
        `watched`: a failure to reach the target is told to `on_unreachable` (not the watch's own calls)."""
        link = self._link  # one snapshot: the call's channel and the generation `abandon_calls` may end
        call = getattr(link, method)
        lane = self.lane.for_call() if method == "verify" else None
        try:
            timeout_s = timeout_s or self.timeout_s
            with (self._waiting(time.monotonic() + timeout_s),
                  blocking_call_metadata(VERIFY_PATH if lane else getattr(call, "_method", TARGET_SERVICE_PATH))
                  as metadata):
                if lane is not None:
                    reply = lane.call(VERIFY_PATH, request.SerializeToString(), timeout_s, metadata)
                else:
                    reply = call(request, timeout=timeout_s, metadata=metadata or None)
            self._answered_over = link.credentials
            return reply
        except grpc.RpcError as exc:
            raise self._failed(exc, link, watched) from None
        except ValueError:  # "Cannot invoke RPC on closed channel!": `abandon_calls` closed it as the call began
            raise self._failed(None, link) from None

    def _failed(self, exc: grpc.RpcError | None, link: _Link, watched: bool = True) -> SpecdecError:
        why = self._abandoned.get(link.generation)
        if why is not None:
            return NotReady(f"{TARGET_PREFIX}{why}")
        if exc is None:
            return SpecdecError(f"{TARGET_PREFIX}the channel was closed")
        if watched and self.on_unreachable is not None and _code(exc) in UNREACHABLE:
            self.on_unreachable()
        return _translate(exc, hint=self._answered_over is not link.credentials)

    @contextlib.contextmanager
    def _waiting(self, deadline: float):
        ident = threading.get_ident()
        calls, latest = self._calling.get(ident, (0, 0.0))
        self._calling[ident] = (calls + 1, max(latest, deadline))
        try:
            yield
        finally:
            calls, latest = self._calling.pop(ident)
            if calls > 1:
                self._calling[ident] = (calls - 1, latest)
            self._left_call[ident] = time.monotonic()

    def since_call(self, thread_id: int | None) -> float | None:
        """Seconds since that thread last came back from waiting for the target, or None if it never waited: its
        own work since then is what a stall watch judges, not the wait before (QA: a 58 s Prefill wait ended and
        the draft counted its step as 58 s long, reported itself stalled and lost its streams)."""
        left = self._left_call.get(thread_id) if thread_id is not None else None
        return None if left is None else time.monotonic() - left

    def waits_on_target(self, thread_id: int | None) -> bool:
        """Whether that thread is waiting for one of the target's answers now, within the call's deadline (any
        thread may ask): the draft's engine thread is not stalled then, its target is slow or away, which the
        target's own stall watch and the draft's target watch judge (`draft_service.app`). A thread still in a call
        `CALL_GRACE_S` past its deadline is stuck in it (gRPC ends a call at its deadline): not waiting."""
        calls = self._calling.get(thread_id) if thread_id is not None else None
        return calls is not None and time.monotonic() < calls[1] + CALL_GRACE_S

    def _start(self, method: str, request, trace_context=None):
        """Send a call of the link's `method` without waiting; `_wait` collects it. Under `trace_context` (a
        request's) it carries that trace and gets its own CLIENT span, ended when the call is collected."""
        link = self._link
        call = getattr(link, method)
        lane = self.lane.for_call() if method == "verify" else None
        stack = contextlib.ExitStack()
        with attached(trace_context):
            metadata = stack.enter_context(blocking_call_metadata(
                VERIFY_PATH if lane else getattr(call, "_method", TARGET_SERVICE_PATH)))
        try:
            if lane is not None:
                future = lane.start(VERIFY_PATH, request.SerializeToString(), self.timeout_s, metadata)
            else:
                future = call.future(request, timeout=self.timeout_s, metadata=metadata or None)
            return stack, future, link, time.monotonic() + self.timeout_s
        except ValueError:  # the channel closed as the call began
            stack.close()
            raise self._failed(None, link) from None
        except grpc.RpcError as exc:  # the lane's connection broke as the call was sent
            with contextlib.suppress(grpc.RpcError):
                stack.__exit__(type(exc), exc, exc.__traceback__)
            raise self._failed(exc, link) from None

    def _wait(self, started):
        stack, future, link, deadline = started
        try:
            with stack, self._waiting(deadline):
                return future.result()
        except grpc.FutureCancelledError:
            raise Cancelled("the request's client left during its admission") from None
        except grpc.RpcError as exc:
            raise self._failed(exc, link) from None

    def prefill(self, inputs: list[PrefillInput]) -> list[PrefillOutput]:
        """All or nothing: the first failure is raised after what the others admitted was released."""
        answers = self.prefill_each(inputs)
        error = next((a for a in answers if isinstance(a, SpecdecError)), None)
        if error is not None:
            for inp, answer in zip(inputs, answers, strict=True):
                if not isinstance(answer, SpecdecError):
                    self._release_quietly(inp.request_id)
            raise error
        return answers

    def prefill_each(self, inputs: list[PrefillInput]) -> list:
        """One Prefill RPC per request, all in flight at once (the target runs those that meet as one forward),
        each in its request's trace; per request its PrefillOutput or its error (SpecdecError)."""
        return self.prefill_collect(self.prefill_send(inputs))

    def prefill_send(self, inputs: list[PrefillInput]):
        """`prefill_each`'s RPCs sent, not waited for: `prefill_ready` tells whether all have answered,
        `prefill_collect` takes the answers (once; it waits for those still out)."""
        if self.feature_wire:
            inputs = [replace(inp, feature_wire=self.feature_wire) for inp in inputs]
        stale = self.pending.take([inp.request_id for inp in inputs])
        if stale:  # an id a request that ended while the target was away held there: free it for the new one
            self._release_now(stale)
        started = [self._start("prefill", prefill_to_proto(inp), inp.trace_context) for inp in inputs]
        with self._admitting_lock:
            self._admitting.update((inp.request_id, call[1]) for inp, call in zip(inputs, started, strict=True))
        return inputs, started

    @staticmethod
    def prefill_ready(sent) -> bool:
        return all(call[1].done() for call in sent[1])

    def prefill_collect(self, sent) -> list:
        inputs, started = sent
        answers: list = []
        try:
            for inp, call in zip(inputs, started, strict=True):
                try:
                    answers.append(self._prefill_output(inp, self._wait(call)))
                except Cancelled as exc:
                    self._release_quietly(inp.request_id)  # the target may have run it before the cancel came
                    answers.append(exc)
                except SpecdecError as exc:
                    answers.append(exc)
        finally:
            with self._admitting_lock:
                for inp in inputs:
                    self._admitting.pop(inp.request_id, None)
        return answers

    def cancel_prefill(self, request_id: str) -> None:
        """Cancel the request's Prefill RPC while it is in flight (`prefill_send` to `prefill_collect`; any thread:
        the event loop's, when the request's client leaves during its admission). The target drops it if its
        forward has not run yet, or stops it after the part under way (a prompt prefilled in parts); if it ran,
        `prefill_collect` releases it. Either way the request's answer is `Cancelled` and the admission drops it.
        Before, a burst of long prompts cancelled at once was prefilled all the same while the requests behind it
        waited (7.1 s against 1.1 s plainly, on a CPU: QA)."""
        with self._admitting_lock:
            future = self._admitting.get(request_id)
        if future is not None:
            future.cancel()

    def _prefill_output(self, inp: PrefillInput, data: bytes) -> PrefillOutput:
        try:
            msg, feats = self._decode(target_pb2.PrefillResponse, data)
            if msg.request_id != inp.request_id or (inp.return_features and feats is None):
                raise MalformedReply(f"{TARGET_PREFIX}malformed Prefill reply for {inp.request_id!r}")
            rows = kept_feature_rows(len(inp.prompt_ids), inp.feature_rows) if inp.return_features else None
            return self._checked(prefill_output_from_proto, msg, feats, expected_rows=rows)
        except MalformedReply:
            self._release_quietly(inp.request_id)  # the target admitted it; nobody else will free it
            raise

    def verify(self, inputs: list[VerifyInput], plain_steps: int = 1, feature_rows: int = 0) -> list[VerifyOutput]:
        """The target's `verify` over gRPC (`plain_steps`: see specdec.engine.plain_steps; `feature_rows` > 0:
        the features of each result's last that many tokens only)."""
        reply = self._call("verify", verify_to_proto(inputs, plain_steps, feature_rows))
        return self._verify_outputs(inputs, plain_steps, feature_rows, reply)

    def verify_start(self, inputs: list[VerifyInput], plain_steps: int = 1, feature_rows: int = 0):
        """Send a Verify without waiting; `verify_finish` collects it. Calls started one after another from one
        thread reach the target in that order (one HTTP/2 connection; the target queues them as they come), which
        pipelined plain calls of the same requests rely on (`TwoBatchOverlap`). Under the current span."""
        started = self._start("verify", verify_to_proto(inputs, plain_steps, feature_rows))
        return inputs, plain_steps, feature_rows, started

    def verify_finish(self, pending) -> list[VerifyOutput]:
        inputs, plain_steps, feature_rows, started = pending
        return self._verify_outputs(inputs, plain_steps, feature_rows, self._wait(started))

    def _verify_outputs(self, inputs: list[VerifyInput], plain_steps: int, feature_rows: int,
                        reply: bytes) -> list[VerifyOutput]:
        msg, feats = self._decode(target_pb2.VerifyResponse, reply)
        ids = [r.request_id for r in msg.results]
        if ids != [i.request_id for i in inputs]:
            raise MalformedReply(f"{TARGET_PREFIX}Verify answered {ids[:4]} for {[i.request_id for i in inputs][:4]}")
        most = max(plain_steps, 1 + max((len(i.draft_tokens) for i in inputs), default=0))  # most tokens a result holds
        for r in msg.results:
            running = r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
            rows = kept_feature_rows(len(r.tokens), feature_rows) if running and self.features else 0
            # no tokens: a plain call naming a request that an earlier call finished (TargetEngine.finished)
            if (running and not r.tokens) or r.num_feature_rows != rows or len(r.tokens) > most:
                raise MalformedReply(f"{TARGET_PREFIX}Verify result for {r.request_id!r} has {len(r.tokens)} tokens "
                                     f"and {r.num_feature_rows} feature rows")
        return self._checked(verify_outputs_from_proto, msg, feats)

    @staticmethod
    def _decode(cls, data: bytes):
        """(reply without its features, the features' tensor message or None); a reply that is not protobuf is the
        target's fault."""
        try:
            msg, feats = decode_with_tensor(cls, data, "features")
        except DecodeError as exc:
            raise MalformedReply(f"{TARGET_PREFIX}reply is not a {cls.DESCRIPTOR.name}: {exc}") from None
        if feats is None and msg.HasField("features"):
            feats = msg.features
        return msg, feats

    def _checked(self, decode, msg, feats, **expected):
        """Decode a reply's features, checking rows and the feature width; a bad blob is the target's fault."""
        try:
            return decode(msg, self.device, features=feats, expected_dim=self.feature_dim or None, **expected)
        except InvalidInput as exc:
            raise MalformedReply(f"{TARGET_PREFIX}malformed features: {exc}") from None

    def _release_quietly(self, request_id: str) -> None:
        with contextlib.suppress(SpecdecError):
            self.release(request_id)

    def release(self, request_id: str) -> None:
        """Release the request on the target; one the target is away for is kept and released once it is back
        (`pending`)."""
        try:
            self._call("release", target_pb2.ReleaseRequest(request_ids=[request_id]))
        except NotReady:
            self.pending.add([request_id])

    def release_later(self, request_ids: list[str]) -> None:
        """Requests that failed because the target is away: released once it answers again (`release_pending`)."""
        self.pending.add(request_ids)

    def release_pending(self, timeout_s: float = 2.0) -> int:
        """Release what `pending` holds, in one call (the draft engine's chore, once its target watch has seen the
        target answer); -> how many were sent. A call that fails keeps them for the next try."""
        ids = self.pending.take()
        if not ids or not self._release_now(ids, timeout_s):
            return 0
        log.info("released %d requests on the target at %s that ended while it was away (its pages free now)",
                 len(ids), self.addr)
        return len(ids)

    def _release_now(self, ids: list[str], timeout_s: float | None = None) -> bool:
        try:
            self._call("release", target_pb2.ReleaseRequest(request_ids=ids), timeout_s, watched=False)
        except SpecdecError:
            self.pending.add(ids)
            return False
        return True

    def target_back(self) -> None:
        """The target watch found the target answering again after an outage: its lane is tried at once."""
        self.lane.retry_now()

    def probe_lane(self, timeout_s: float) -> None:
        """The target watch's look at the verify lane, once the target answered over gRPC (`VerifyLane.probe`)."""
        self.lane.probe(VERIFY_PATH, timeout_s)

    def model_info(self, timeout_s: float | None = None) -> target_pb2.TargetServiceGetModelInfoResponse:
        """The target's GetModelInfo; its verify lane (or none) is taken from the answer."""
        info = self._call("model_info", target_pb2.TargetServiceGetModelInfoRequest(), timeout_s, watched=False)
        self.lane.told(info.verify_lane_port)
        # the target's part size as it is now: a target restarted with another --prefill-chunk-tokens (a rolling
        # update) was admitted for with the part size of the one the draft started against (QA: started against
        # one that prefills in one forward, the draft kept blocking its running streams for a long prompt's whole
        # prefill after the target came back prefilling in parts, a 2.0-2.8 s gap against 0.3-0.7 s)
        self.prefill_chunk_tokens = info.prefill_chunk_tokens
        return info

    def close(self) -> None:
        self.lane.close()
        self._link.channel.close()
        for _, channel in self._retiring:
            channel.close()
