"""A small synchronous Python client of the gateway.

    from gateway.client import GatewayClient

    with GatewayClient("localhost:50050") as client:
        stream = client.generate("def fib(n):", max_new_tokens=32)
        for text in stream:                  # text deltas, complete UTF-8 characters
            print(text, end="", flush=True)
        print(stream.stats)                  # finish reason, token counts, tau, timings

        text, stats = client.complete([{"role": "user", "content": "Write a haiku"}], temperature=0.7, seed=1)

Errors are `grpc.RpcError`s with the gateway's status and message (`exc.code()`, `exc.details()`); a request the
message cannot hold is `InvalidInput` before anything is sent, and a call on a closed client a `RuntimeError`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import grpc

from specdec.errors import InvalidInput
from specdec.rpc.options import channel_options
from specdec.rpc.tls import TlsConfig
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

Messages = Sequence[dict[str, str]]
CHAT_KEYS = ("role", "content")  # what each chat message needs (ChatMessage's fields)


@dataclass(frozen=True)
class GenerationStats:
    """A finished generation's `GatewayStats`, field for field."""

    finish_reason: str  # "stop", "length" or "abort"
    prompt_tokens: int
    completion_tokens: int
    tau: float  # tokens per target step (0 without speculation)
    accepted_per_position: tuple[int, ...]
    time_to_first_token_s: float
    total_s: float
    speculative: bool
    request_id: str
    fallbacks: int = 0  # times the stream continued elsewhere after a service under it failed

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.total_s if self.total_s > 0 else 0.0

    @classmethod
    def from_proto(cls, msg: gateway_pb2.GatewayStats) -> GenerationStats:
        reason = common_pb2.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
        return cls(
            finish_reason=reason,
            prompt_tokens=msg.prompt_tokens,
            completion_tokens=msg.completion_tokens,
            tau=msg.tau,
            accepted_per_position=tuple(msg.accepted_per_position),
            time_to_first_token_s=msg.time_to_first_token_s,
            total_s=msg.total_s,
            speculative=msg.speculative,
            request_id=msg.request_id,
            fallbacks=msg.fallbacks,
        )


class GenerationStream:
    """Iterate for text deltas; `stats` is set once the stream ended; `cancel()` stops it (and the work): an
    iteration under way then ends quietly, `stats` None."""

    def __init__(self, call) -> None:
        self._call = call
        self._cancelled = False
        self.stats: GenerationStats | None = None
        self.token_ids: list[int] = []

    def __iter__(self) -> Iterator[str]:
        ended = False
        try:
            for response in self._call:
                self.token_ids.extend(response.token_ids)
                if response.HasField("final"):
                    self.stats = GenerationStats.from_proto(response.final)
                if response.text:
                    yield response.text
            ended = True
        except grpc.RpcError as exc:
            if not (self._cancelled and exc.code() == grpc.StatusCode.CANCELLED):
                raise  # (our own cancel: gRPC's "Locally cancelled by application!" reached the caller raw, QA)
            ended = True
        finally:
            if not ended:  # the caller left the loop (`break`) or it failed: stop the work on the server too
                self.cancel()  # (a later iteration then ends at once, quietly: it raised CANCELLED raw, QA)

    def cancel(self) -> None:
        self._cancelled = True
        self._call.cancel()


class GatewayClient:
    def __init__(
        self,
        addr: str = "localhost:50050",
        *,
        api_key: str | None = None,
        tls: TlsConfig | None = None,
        timeout_s: float | None = None,
    ) -> None:
        if timeout_s is not None and (isinstance(timeout_s, bool) or not (isinstance(timeout_s, int | float)
                                                                          and 0 < timeout_s < math.inf)):
            # (inf, nan, 0 and -1 failed every call at once with DEADLINE_EXCEEDED: QA)
            raise InvalidInput(f"timeout_s must be a positive finite number of seconds or None, not {timeout_s!r}")
        options = channel_options()
        if tls is None:
            self._channel = grpc.insecure_channel(addr, options=options)
        else:
            self._channel = grpc.secure_channel(addr, tls.channel_credentials(), options=options)
        self._stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._timeout_s = timeout_s
        self._closed = False

    def generate(
        self,
        prompt: str | Messages,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        seed: int | None = None,
        ignore_eos: bool | None = None,
        stop: str | Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        no_speculation: bool = False,
        request_id: str = "",
        spec: Mapping[str, int] | None = None,
    ) -> GenerationStream:
        """Stream a completion of `prompt` (text) or a chat reply (`[{"role": ..., "content": ...}, ...]`). `stop`: one
        stop string or a list of them. `spec`: this request's own smaller tree (`num_steps`, `topk`,
        `num_draft_tokens`, each up to the draft service's). A value the request message cannot hold (a negative
        seed, a string temperature, an unknown `spec` key, a chat message without content, a stop that is not a
        str) raises `InvalidInput` here; the gateway checks the rest (INVALID_ARGUMENT)."""
        sampling = _sampling(stop_token_ids=stop_token_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                             top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, ignore_eos=ignore_eos)
        chat = None if isinstance(prompt, str) else _chat(prompt)
        stops = _stop_strings(stop)
        try:  # protobuf refuses these as ValueError / TypeError
            request = gateway_pb2.GatewayServiceGenerateRequest(
                sampling=sampling, stop=stops, no_speculation=no_speculation, request_id=request_id
            )
            if spec is not None:
                request.spec.CopyFrom(common_pb2.SpecParams(**spec))
            if chat is None:
                request.prompt = prompt
            else:
                request.chat.CopyFrom(chat)
        except (ValueError, TypeError, AttributeError) as exc:
            raise InvalidInput(f"bad request: {type(exc).__name__}: {exc}") from exc
        self._check_open()
        return GenerationStream(self._stub.Generate(request, timeout=self._timeout_s, metadata=self._metadata))

    def complete(self, prompt: str | Messages, **kwargs) -> tuple[str, GenerationStats]:
        """The whole text and its stats (see `generate` for the arguments)."""
        stream = self.generate(prompt, **kwargs)
        text = "".join(stream)
        return text, stream.stats

    def tokenize(self, text: str | Messages) -> list[int]:
        request = gateway_pb2.TokenizeRequest()
        if isinstance(text, str):
            try:  # a lone surrogate: protobuf's UnicodeEncodeError (QA)
                request.text = text
            except (ValueError, TypeError) as exc:
                raise InvalidInput(f"bad request: text: {type(exc).__name__}: {exc}") from exc
        else:
            request.chat.CopyFrom(_chat(text))
        return list(self._unary(self._stub.Tokenize, request).token_ids)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        try:  # protobuf's own TypeError names no argument
            request = gateway_pb2.DetokenizeRequest(token_ids=list(token_ids))
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"bad request: token_ids must be a list of int token ids ({exc})") from exc
        return self._unary(self._stub.Detokenize, request).text

    def list_models(self) -> list[gateway_pb2.ModelCard]:
        return list(self._unary(self._stub.ListModels, gateway_pb2.ListModelsRequest()).models)

    def _unary(self, method, request):
        self._check_open()
        return method(request, timeout=self._timeout_s, metadata=self._metadata)

    def _check_open(self) -> None:
        if self._closed:  # (gRPC's own `ValueError: Cannot invoke RPC: Channel closed!` named no client, QA)
            raise RuntimeError("this GatewayClient is closed (close() or its `with` block ended): make a new one")

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _sampling(**fields) -> common_pb2.SamplingParams:
    """The request's sampling fields that are set; a value the message cannot hold (a negative seed) is
    `InvalidInput` naming its field (protobuf's own message names none)."""
    sampling = common_pb2.SamplingParams()
    for name, value in fields.items():
        try:
            if name == "stop_token_ids":
                sampling.stop_token_ids.extend(value or ())  # None: none, as for the other fields
            elif value is not None:
                setattr(sampling, name, value)
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"bad request: {name} {value!r}: {exc}") from exc
    return sampling


def _stop_strings(stop: str | Sequence[str] | None) -> list[str]:
    """A str is one stop string (as in OpenAI's API): `list("fib(")` made four one-character ones (QA)."""
    if isinstance(stop, str):
        return [stop]
    if stop is None:
        return []
    stops = list(stop) if isinstance(stop, Iterable) else [stop]
    bad = [s for s in stops if not isinstance(s, str)]
    if bad:
        raise InvalidInput(f"bad request: stop must be a str or a list of str, not {type(bad[0]).__name__} "
                           f"{bad[0]!r:.80}")
    return stops


def _chat(messages: Messages) -> gateway_pb2.ChatMessages:
    """A chat as the request holds it; a message that is not a dict of text `role` and `content` is `InvalidInput`
    naming the message and the key (QA: a message without content said only `KeyError: 'content'`)."""
    if not isinstance(messages, Sequence):  # None or a number raised a bare TypeError; a dict gave its keys
        raise InvalidInput(f"bad request: the input must be a str or a list of chat messages, not "
                           f"{type(messages).__name__}")
    chat = gateway_pb2.ChatMessages()
    for i, message in enumerate(messages):
        _check_message(i, message)
        try:  # text a message cannot hold (a lone surrogate: UnicodeEncodeError, QA)
            chat.messages.append(gateway_pb2.ChatMessage(role=message["role"], content=message["content"]))
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"bad request: chat message {i}: {type(exc).__name__}: {exc}") from exc
    return chat


def _check_message(index: int, message) -> None:
    if not isinstance(message, Mapping):
        raise InvalidInput(f"bad request: chat message {index} is a {type(message).__name__}, not a dict with "
                           f"'role' and 'content'")
    for key in CHAT_KEYS:
        if key not in message:
            raise InvalidInput(f"bad request: chat message {index} has no {key!r} (each needs 'role' and 'content')")
        if not isinstance(message[key], str):
            raise InvalidInput(f"bad request: chat message {index}'s {key!r} is a {type(message[key]).__name__}, "
                               f"not a str")
