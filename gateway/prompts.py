"""Request input -> prompt token ids: raw text as plain text, chat messages through the chat template.

Special-token strings typed by a user (`<|separator|>`, `<|eos|>`) stay plain text in both cases: only the
chat template itself inserts control tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import InvalidInput
from specdec.tokenizer import Tokenizer
from specdec.v1 import gateway_pb2

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class EncodedInput:
    token_ids: tuple[int, ...]
    is_chat: bool


def encode_input(
    tokenizer: Tokenizer, request: gateway_pb2.GatewayServiceGenerateRequest | gateway_pb2.TokenizeRequest
) -> EncodedInput:
    """Token ids of the request's `input` oneof (`prompt`/`text` or `chat`); InvalidInput if it is unset."""
    which = request.WhichOneof("input")
    if which is None:
        text_field = "prompt" if isinstance(request, gateway_pb2.GatewayServiceGenerateRequest) else "text"
        raise InvalidInput(f"set exactly one of {text_field} or chat")
    if which == "chat":
        return EncodedInput(tuple(encode_chat(tokenizer, request.chat)), is_chat=True)
    return EncodedInput(tuple(tokenizer.encode(getattr(request, which))), is_chat=False)


def encode_chat(tokenizer: Tokenizer, chat: gateway_pb2.ChatMessages) -> list[int]:
    if not chat.messages:
        raise InvalidInput("chat has no messages")
    for i, message in enumerate(chat.messages):
        if message.role not in CHAT_ROLES:
            raise InvalidInput(f"chat message {i}: role {message.role!r} is not one of {', '.join(CHAT_ROLES)}")
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
