"""`GatewayService`: text in, routed generation, text deltas out; plus Tokenize, Detokenize, ListModels."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio
from opentelemetry import trace

from gateway.auth import client_identity
from gateway.config import GatewayLimits
from gateway.downstream import Chunk, Finish
from gateway.downstream_ids import DownstreamIds
from gateway.fallback import FINISH_STOP, FallbackGeneration, GenerationPlan
from gateway.interceptors import name_request_id
from gateway.limits import (
    StreamSlots,
    check_detokenize_ids,
    check_input_chars,
    check_prompt_chars,
    check_prompt_length,
    check_request_id,
    check_stop_strings,
    resolve_sampling,
)
from gateway.prompts import EncodedInput, RequestInput, decode_ids, encode_input, read_input
from gateway.router import Router
from gateway.stream import TextStream
from specdec.rpc.errors import end_call, map_servicer_errors
from specdec.rpc.metadata import downstream_timeout, request_id_from
from specdec.sampling_params import MAX_STOP_TOKEN_IDS
from specdec.spec_params import asked_tree_shape, check_fits
from specdec.telemetry import bind_request_id, get_tracer
from specdec.tokenizer import Tokenizer
from specdec.v1 import gateway_pb2, gateway_pb2_grpc

GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


@map_servicer_errors
class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, tokenizer: Tokenizer, router: Router, limits: GatewayLimits, model_dir: str,
                 clients_by_key: bool = False, served_model_name: str = "", pair_wait_s: float = 0.0) -> None:
        self._tokenizer = tokenizer
        self._router = router
        self._limits = limits
        self._slots = StreamSlots(limits.max_concurrent_streams, limits.max_streams_per_client)
        self._clients_by_key = clients_by_key  # API keys are checked: a key identifies a client
        self._model_dir = model_dir  # ListModels' target until a pair answers: the --model the gateway was given
        self._served_model_name = served_model_name  # ListModels' id; "": the target's model name
        self._pair_wait_s = pair_wait_s  # a request's wait for a pair while none is up (`FallbackGeneration`)
        self._ids = DownstreamIds()  # the ids streams run under downstream: one client id may name several

    # -- Generate -------------------------------------------------------------------------------------------
    async def Generate(self, request, context):
        started = time.monotonic()
        # the body's id, else the caller's `x-request-id` metadata (checked alike: it reaches the same logs and
        # downstream calls), else a generated one
        request_id = check_request_id(request.request_id or request_id_from(context) or "") or uuid.uuid4().hex
        trace.get_current_span().set_attribute("specdec.request_id", request_id)  # the one it goes by, generated too
        name_request_id(request_id)
        with bind_request_id(request_id):
            plan, stops = await self._plan(request, request_id)
            with self._slots.hold(client_identity(context, self._clients_by_key)):
                generation = FallbackGeneration(self._router, plan, lambda: downstream_timeout(context),
                                                self._pair_wait_s, self._ids)
                try:
                    async for response in self._stream(generation, plan, stops, started):
                        yield response
                except grpc.aio.AioRpcError as exc:  # a downstream refusal (bad input, KV full, deadline)
                    pass_on(context, exc)

    async def _plan(self, request, request_id: str) -> tuple[GenerationPlan, GatewayStops]:
        """Validate the request and turn it into what the pair runs and where the gateway itself stops it, the
        cheap checks before tokenizing; raises InvalidInput."""
        spec = request.spec if request.HasField("spec") else None
        if spec is not None:
            asked = asked_tree_shape(spec)  # on every route: with no_speculation too
            # the drafts' own bounds, whether one is up or the request falls back to a target
            check_fits(asked, [p.draft_shape for p in self._router.pairs if p.draft_shape], "the draft service")
        sampling = resolve_sampling(
            request.sampling if request.HasField("sampling") else None, self._limits, self._tokenizer.vocab_size
        )
        stop = check_stop_strings(request.stop)
        encoded = await self._encode_prompt(request)
        stop_ids, own_stop_ids = self._stop_token_ids(encoded, sampling.stop_token_ids, sampling.ignore_eos)
        finish_ids = (*stop_ids, *own_stop_ids, *(() if sampling.ignore_eos else self._tokenizer.eos_token_ids))
        plan = GenerationPlan(
            request_id=request_id,
            prompt_ids=encoded.token_ids,
            sampling=dataclasses.replace(sampling, stop_token_ids=stop_ids),
            speculative=not request.no_speculation,
            finish_token_ids=frozenset(finish_ids),
            spec=spec,
        )
        return plan, GatewayStops(stop, own_stop_ids)

    async def _encode_prompt(self, request) -> EncodedInput:
        prompt, max_context_len = read_input(request), self._max_context_len()
        check_input_chars(prompt.num_chars, self._limits)  # first: the documented limit, and the cheapest check
        encoded = await self._tokenize(prompt, max_context_len)
        check_prompt_length(len(encoded.token_ids), self._limits, max_context_len)
        return encoded

    async def _tokenize(self, prompt: RequestInput, max_context_len: int) -> EncodedInput:
        """A prompt that cannot fit even at its least number of tokens is refused before it is encoded."""
        fits = functools.partial(check_prompt_chars, limits=self._limits, max_context_len=max_context_len)
        # the span covers the tokenizing alone: a refused request's error belongs to its server span, not here
        with get_tracer().start_as_current_span("gateway.tokenize", record_exception=False,
                                                set_status_on_exception=False) as span:
            encoded = await encode_input(self._tokenizer, prompt, fits)
            span.set_attribute("num_prompt_tokens", len(encoded.token_ids))
        return encoded

    def _stop_token_ids(
        self, encoded: EncodedInput, requested: tuple[int, ...], ignore_eos: bool
    ) -> tuple[tuple[int, ...], frozenset[int]]:
        """(stop ids the services get, stop ids the gateway stops the stream at itself). A chat reply also ends at
        the template's `chat_stop_token_ids` (unless the client ignores eos): they go downstream with the client's
        ids (deduplicated) as far as `MAX_STOP_TOKEN_IDS` holds them, which the services check again; the rest
        only the gateway knows. Adding them all refused a chat with the documented maximum of 1024 ids (QA)."""
        requested = tuple(dict.fromkeys(requested))
        if not encoded.is_chat or ignore_eos:
            return requested, frozenset()
        added = [i for i in self._tokenizer.chat_stop_token_ids if i not in requested]
        room = max(MAX_STOP_TOKEN_IDS - len(requested), 0)
        return (*requested, *added[:room]), frozenset(added[room:])

    def _max_context_len(self) -> int:
        """The smallest context of the pairs up, or while none is, of those that answered once (ListModels kept
        saying 0 after every pair had gone down)."""
        pairs = [p for p in self._router.pairs if p.usable] or self._router.pairs
        return min((p.max_context_len for p in pairs if p.max_context_len), default=0)

    async def _stream(
        self, generation: FallbackGeneration, plan: GenerationPlan, stops: GatewayStops, started: float
    ) -> AsyncIterator[gateway_pb2.GatewayServiceGenerateResponse]:
        text = TextStream(self._tokenizer, stops.strings)
        first_text_at: float | None = None
        first_ids_at: float | None = None
        async with contextlib.aclosing(generation.run()) as chunks:
            async for chunk in chunks:
                token_ids, finish = stops.cut(chunk)
                delta = text.push(token_ids)
                if text.stopped or finish is not None:
                    delta += text.flush()  # (nothing after a stop; it may find a stop string held till the end)
                finish = Finish(FINISH_STOP) if text.stopped else finish
                ids = text.ids  # a stop string ends the ids at the token that completed it
                if delta and first_text_at is None:
                    first_text_at = time.monotonic()
                if ids and first_ids_at is None:
                    first_ids_at = time.monotonic()
                response = gateway_pb2.GatewayServiceGenerateResponse(text=delta, token_ids=ids)
                if finish is not None:
                    unused = len(generation.generated) - text.sent  # past a stop string or a stop id
                    first_at = first_text_at or first_ids_at  # no text sent: when its first ids went out
                    response.final.CopyFrom(self._stats(generation, plan, finish, started, first_at, unused))
                    yield response
                    return  # leaving the loop closes the downstream stream (a stop string cancels it)
                if delta or chunk.token_ids:
                    yield response

    def _stats(
        self,
        generation: FallbackGeneration,
        plan: GenerationPlan,
        finish: Finish,
        started: float,
        first_sent_at: float | None,
        unused: int = 0,
    ) -> gateway_pb2.GatewayStats:
        now = time.monotonic()
        speculative = generation.speculative
        return gateway_pb2.GatewayStats(
            finish_reason=finish.reason,
            prompt_tokens=len(plan.prompt_ids),
            completion_tokens=len(generation.generated) - unused,  # not those past a stop string or stop id
            tau=finish.tau if speculative else 0.0,
            accepted_per_position=list(finish.accepted_per_position) if speculative else [],
            time_to_first_token_s=(first_sent_at or now) - started,
            total_s=now - started,
            speculative=speculative,
            request_id=plan.request_id,
            fallbacks=generation.num_fallbacks,
        )

    # -- the rest -------------------------------------------------------------------------------------------
    async def Tokenize(self, request, context):
        text = read_input(request)
        check_input_chars(text.num_chars, self._limits)
        encoded = await encode_input(self._tokenizer, text)
        return gateway_pb2.TokenizeResponse(token_ids=encoded.token_ids)

    async def Detokenize(self, request, context):
        check_detokenize_ids(len(request.token_ids), self._limits)
        return gateway_pb2.DetokenizeResponse(text=await decode_ids(self._tokenizer, request.token_ids))

    async def ListModels(self, request, context):
        up = [p for p in self._router.pairs if p.usable]
        known = up or self._router.pairs
        # a path both before a pair answered (the gateway's own --model) and after (the path the target loaded):
        # the target was the bare name "target" first, then "/work/.../target"
        target = next((p.target_model for p in known if p.target_model), self._model_dir)
        draft = next((p.draft_model for p in known if p.draft_model), "")
        # the id is the model's name, not where a service loaded it from: the same before and after
        card = gateway_pb2.ModelCard(id=self._served_model_name or Path(target).name, target=target, draft=draft,
                                     max_context_len=self._max_context_len(), pairs_up=len(up))
        return gateway_pb2.ListModelsResponse(models=[card])


@dataclass(frozen=True)
class GatewayStops:
    """Where the gateway itself ends a stream: at stop strings, and at stop ids the services were not given (a
    chat template's beyond `MAX_STOP_TOKEN_IDS`)."""

    strings: tuple[str, ...]
    token_ids: frozenset[int] = frozenset()

    def cut(self, chunk: Chunk) -> tuple[tuple[int, ...], Finish | None]:
        """The chunk's ids through the first of `token_ids`, finishing there (STOP); else the chunk as it is."""
        for n, token_id in enumerate(chunk.token_ids, 1):
            if token_id in self.token_ids:
                return chunk.token_ids[:n], Finish(FINISH_STOP)
        return chunk.token_ids, chunk.finish


def pass_on(context: grpc.aio.ServicerContext, exc: grpc.aio.AioRpcError) -> None:
    """End the client's call with a downstream service's status (sent when the handler returns: `end_call`),
    unless the call has ended already: its deadline passed or it cancelled, and the downstream error is the echo
    of that (an abort then failed inside grpc, "Abort already called!", logged as an unhandled ERROR for 8 of 200
    expired deadlines in QA)."""
    if not (context.done() or context.cancelled()):
        end_call(context, exc.code(), exc.details() or exc.code().name)

