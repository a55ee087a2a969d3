"""Admission checks: prompt and generation lengths, stop strings, sampling ranges, concurrent streams.

Bad input raises `InvalidInput` (INVALID_ARGUMENT); a gateway already running its maximum number of streams
raises `TooManyStreams` (RESOURCE_EXHAUSTED). Both carry a message that names the limit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from gateway.config import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, GatewayLimits
from specdec.errors import InvalidInput, SpecdecError
from specdec.request_ids import check_not_reserved
from specdec.rpc.sampling_codec import sampling_from_proto
from specdec.sampling_params import SamplingParams
from specdec.v1 import common_pb2


class TooManyStreams(SpecdecError):
    status = "RESOURCE_EXHAUSTED"


def check_prompt_length(num_tokens: int, limits: GatewayLimits, max_context_len: int = 0) -> None:
    """The prompt must be non-empty, within --max-prompt-tokens and leave room for one token in the context."""
    if num_tokens == 0:
        raise InvalidInput("the prompt is empty")
    _check_fits(num_tokens, f"{num_tokens} tokens", limits, max_context_len)


def check_input_chars(num_chars: int, limits: GatewayLimits) -> None:
    """Any input (a prompt, a chat's contents, a Tokenize text) within --max-input-chars, before tokenizing."""
    if num_chars > limits.max_input_chars:
        raise InvalidInput(f"the input has {num_chars} characters; the limit is {limits.max_input_chars} "
                           "(--max-input-chars)")


def max_request_bytes(limits: GatewayLimits) -> int:
    """The largest request message the gateway receives: `--max-input-chars` characters of UTF-8 (4 bytes each at
    most; as many Detokenize ids take at most 3 bytes each), plus 1 MiB for the rest (a chat's 4096 messages' roles
    and framing, 16 stop strings of 256 characters); gRPC refuses a larger one RESOURCE_EXHAUSTED before it is
    parsed. Under the 256 MiB the services take, a 40 MB Detokenize (20 M ids) was read, parsed and decoded, and a
    running stream's longest gap was 5.4 s."""
    return max(4 * limits.max_input_chars + (1 << 20), 4 << 20)


def check_detokenize_ids(num_ids: int, limits: GatewayLimits) -> None:
    """A Detokenize takes as many ids as a Tokenize takes characters (--max-input-chars), before decoding: 20 M
    ids were decoded on the event loop (every running stream stalled; 4 M ids: 0.57-1.2 s), and their text was
    larger than a client takes by default."""
    if num_ids > limits.max_input_chars:
        raise InvalidInput(f"token_ids has {num_ids} ids; the limit is {limits.max_input_chars} (--max-input-chars)")


def check_prompt_chars(num_chars: int, min_tokens: int, limits: GatewayLimits, max_context_len: int = 0) -> None:
    """Before tokenizing: a text of `num_chars` characters has at least `min_tokens` tokens
    (`Tokenizer.min_num_tokens`); if even that many do not fit, refuse it untokenized (a 100 MB prompt took
    15 s to tokenize)."""
    _check_fits(min_tokens, f"at least {min_tokens} tokens ({num_chars} characters)", limits, max_context_len)


def _check_fits(num_tokens: int, counted: str, limits: GatewayLimits, max_context_len: int) -> None:
    if limits.max_prompt_tokens is not None and num_tokens > limits.max_prompt_tokens:
        raise InvalidInput(f"the prompt has {counted}; the limit is {limits.max_prompt_tokens}")
    if max_context_len and num_tokens >= max_context_len:
        raise InvalidInput(
            f"the prompt has {counted}; the model's context holds {max_context_len} "
            "(prompt plus at least one new token)"
        )


def resolve_sampling(msg: common_pb2.SamplingParams | None, limits: GatewayLimits, vocab_size: int) -> SamplingParams:
    """Sampling params with the gateway's default max_new_tokens, checked against ranges and limits."""
    params = sampling_from_proto(msg, default_max_new_tokens=limits.default_max_new_tokens)
    return params.validate(vocab_size=vocab_size, max_new_tokens_limit=limits.max_new_tokens)


MAX_REQUEST_ID_CHARS = 128


def check_request_id(request_id: str) -> str:
    """A client's request id travels downstream in metadata (`x-request-id`): printable ASCII, at most 128,
    not the services' reserved warm-up prefix."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidInput(f"request_id is {len(request_id)} characters long; the limit is {MAX_REQUEST_ID_CHARS}")
    if not all(" " <= c <= "~" for c in request_id):
        raise InvalidInput("request_id must be printable ASCII")
    return check_not_reserved(request_id)


def check_stop_strings(stop: Sequence[str]) -> tuple[str, ...]:
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidInput(f"{len(stop)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
    for s in stop:
        if not s:
            raise InvalidInput("stop strings must not be empty")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidInput(f"a stop string is {len(s)} characters long; the limit is {MAX_STOP_STRING_CHARS}")
    return tuple(stop)


class StreamSlots:
    """At most `limit` Generate streams at once and `per_client` per client (None: no limit); the next one is
    refused, not queued."""

    def __init__(self, limit: int | None, per_client: int | None = None) -> None:
        self.limit, self.per_client = limit, per_client
        self.active = 0
        self.by_client: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, client: str = "") -> Iterator[None]:
        if self.limit is not None and self.active >= self.limit:
            raise TooManyStreams(f"too many concurrent streams (limit {self.limit}); retry later")
        mine = self.by_client.get(client, 0)
        if self.per_client is not None and mine >= self.per_client:
            raise TooManyStreams(f"too many concurrent streams from this client (limit {self.per_client}); "
                                 "retry later")
        self.active += 1
        self.by_client[client] = mine + 1
        try:
            yield
        finally:
            self.active -= 1
            left = self.by_client[client] - 1
            if left:
                self.by_client[client] = left
            else:
                del self.by_client[client]
