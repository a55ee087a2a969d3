"""Export a tokenizer's vocabulary for grammar engines (structured output): token bytes by id and stop ids.

Format `specdec.vocab.v1` (JSON-serialisable):
    {"format": "specdec.vocab.v1", "vocab_size": 8192,
     "token_bytes_hex": ["3c7c7061647c3e", ...],  # [vocab_size], null where no token has the id
     "special_tokens": {"<|eos|>": 2, ...},        # grammar engines must never emit these as text
     "eos_token_ids": [2], "chat_stop_token_ids": [2, 1]}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdec.tokenizer.tokenizer import Tokenizer

VOCAB_EXPORT_FORMAT = "specdec.vocab.v1"


def export_vocab(tokenizer: Tokenizer) -> dict:
    token_bytes_hex = [
        tokenizer.token_bytes(token_id).hex() if tokenizer.has_token(token_id) else None
        for token_id in range(tokenizer.vocab_size)
    ]
    return {
        "format": VOCAB_EXPORT_FORMAT,
        "vocab_size": tokenizer.vocab_size,
        "token_bytes_hex": token_bytes_hex,
        "special_tokens": dict(tokenizer.special_tokens),
        "eos_token_ids": list(tokenizer.eos_token_ids),
        "chat_stop_token_ids": list(tokenizer.chat_stop_token_ids),
    }


def token_bytes_from_export(exported: dict) -> list[bytes | None]:
    """The inverse of `token_bytes_hex`, for consumers of the export."""
    return [None if hex_text is None else bytes.fromhex(hex_text) for hex_text in exported["token_bytes_hex"]]
