"""Request input -> prompt token ids: raw text as plain text, chat messages through the chat template.

Special-token strings typed by a user (`<|separator|>`, `<|eos|>`) stay plain text in both cases: only the
chat template itself inserts control tokens.

A large input is tokenized on a worker thread (tiktoken releases the GIL), so one client's big prompt does not
stall every other stream and the health checks on the event loop; a small one is tokenized in place. A chat
counts its messages towards "large" too (the template's work per message), and may have at most
`MAX_CHAT_MESSAGES` of them, counted before any is read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import MAX_CHAT_MESSAGES
from specdec.errors import InvalidInput
from specdec.tokenizer import Tokenizer
from specdec.v1 import gateway_pb2

CHAT_ROLES = ("system", "user", "assistant")

# Measured on the tiny model's 8k vocabulary with Python source text (2-core box): an `asyncio.to_thread` round
# trip costs 64 us (median; p90 77 us); encoding costs 34 us per 1000 characters (4.5 us at 100, 0.56 ms at
# 16k, 37 ms at 1M). From 16k characters a prompt would hold the loop for ~9 hops' worth: below that the hop
# is not worth it, above it blocking grows without bound.
OFF_LOOP_MIN_CHARS = 16_384
# Decoding costs ~23 ns an id (0.37 ms for 16k ids, 107 ms for 720k): off the loop from as many ids as characters
OFF_LOOP_MIN_IDS = OFF_LOOP_MIN_CHARS
# The chat template's work per message, in characters whose encoding costs as much: ~4 us a message (4096
# one-character messages: 16 ms), the encoding of ~70-140 characters. So 128+ short messages go off the loop too;
# counting their contents alone kept 4096 of them on it.
MESSAGE_COST_CHARS = 128


@dataclass(frozen=True)
class RequestInput:
    """The request's `input` oneof, read once: every read of a protobuf string field copies it (40 ms at 100 MB)."""

    text: str | None  # `prompt` (Generate) or `text` (Tokenize); None for a chat
    messages: tuple[dict, ...] = ()

    @property
    def num_chars(self) -> int:
        """What --max-input-chars counts: the text, or a chat's contents."""
        return len(self.text) if self.text is not None else sum(len(m["content"]) for m in self.messages)

    @property
    def cost_chars(self) -> int:
        """The work of encoding it, in characters: a chat's messages cost the template's work each."""
        return self.num_chars + MESSAGE_COST_CHARS * len(self.messages)


@dataclass(frozen=True)
class EncodedInput:
    token_ids: tuple[int, ...]
    is_chat: bool


def read_input(request: gateway_pb2.GatewayServiceGenerateRequest | gateway_pb2.TokenizeRequest) -> RequestInput:
    """The request's `input` oneof (`prompt`/`text` or `chat`), checked; InvalidInput if it is unset."""
    which = request.WhichOneof("input")
    if which is None:
        text_field = "prompt" if isinstance(request, gateway_pb2.GatewayServiceGenerateRequest) else "text"
        raise InvalidInput(f"set exactly one of {text_field} or chat")
    if which == "chat":
        return RequestInput(None, chat_messages(request.chat))
    return RequestInput(getattr(request, which))


# check(characters, at least this many tokens) before any text is encoded; raises to refuse the input
BoundCheck = Callable[[int, int], None]


async def encode_input(tokenizer: Tokenizer, request: RequestInput, check: BoundCheck | None = None) -> EncodedInput:
    """Token ids of `request`; off the event loop from `OFF_LOOP_MIN_CHARS` characters' worth of work. `check`
    sees the input's least number of tokens first (`Tokenizer.min_num_tokens`): a text's before the hop, a chat's
    once the template has rendered it (a chat of 4 M characters was encoded whole, ~2 M ids, before its length
    was refused: QA)."""
    if check is not None and request.text is not None:
        check(len(request.text), tokenizer.min_num_tokens(request.text))
    if request.cost_chars < OFF_LOOP_MIN_CHARS:
        return _encode(tokenizer, request, check)
    return await asyncio.to_thread(_encode, tokenizer, request, check)


def _encode(tokenizer: Tokenizer, request: RequestInput, check: BoundCheck | None) -> EncodedInput:
    if request.text is None:
        pieces = tokenizer.chat_pieces(list(request.messages))
        if check is not None:
            check(sum(len(p) for p in pieces if isinstance(p, str)), tokenizer.min_num_chat_tokens(pieces))
        return EncodedInput(tuple(tokenizer.encode_chat_pieces(pieces)), is_chat=True)
    return EncodedInput(tuple(tokenizer.encode(request.text)), is_chat=False)


def chat_messages(chat: gateway_pb2.ChatMessages) -> tuple[dict, ...]:
    num_messages = len(chat.messages)  # O(1): a chat with too many is refused before any of them is read
    if not num_messages:
        raise InvalidInput("chat has no messages")
    if num_messages > MAX_CHAT_MESSAGES:
        raise InvalidInput(f"chat has {num_messages} messages; at most {MAX_CHAT_MESSAGES} are allowed")
    for i, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidInput(f"chat message {i}: role {message.role!r} is not one of {', '.join(CHAT_ROLES)}")
    return tuple({"role": m.role, "content": m.content} for m in chat.messages)


async def decode_ids(tokenizer: Tokenizer, token_ids) -> str:
    """Detokenize's text; off the event loop from `OFF_LOOP_MIN_IDS` ids, a part at a time: one decode call holds
    the interpreter lock throughout, so the event loop waited for a whole large one all the same."""
    if len(token_ids) < OFF_LOOP_MIN_IDS:
        return tokenizer.decode(token_ids)
    # the ids become Python ints on the worker thread, a part at a time, not on the event loop (4 M: ~0.2 s)
    step = OFF_LOOP_MIN_IDS
    parts = (token_ids[i : i + step] for i in range(0, len(token_ids), step))
    return await asyncio.to_thread(tokenizer.decode_parts, parts)
