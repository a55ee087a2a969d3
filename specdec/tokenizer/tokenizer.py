"""`Tokenizer`: text <-> token ids for one vocabulary, plus its chat template and stop ids.

Every supported format is run by tiktoken (a byte-level BPE in Rust). Special tokens come from text only when
the caller allows them: `encode(text)` treats `"<|eos|>"` in text as the characters `<`, `|`, `e`, ...
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import tiktoken

from specdec.errors import InvalidInput
from specdec.tokenizer.bpe_vocab import BpeVocab
from specdec.tokenizer.chat_template import ChatTemplate, encode_pieces
from specdec.tokenizer.vocab_export import export_vocab

AllowedSpecial = Literal["all", "default"] | set[str] | frozenset[str] | None

# Unicode's longest canonical decomposition is 4 code points (U+1F82 = alpha + 3 marks; checked by a test), so
# normalizing (any form: it decomposes, then at most recomposes) leaves at least a quarter of a text's code points.
MAX_CODE_POINTS_COMPOSED = 4


class Tokenizer:
    def __init__(
        self,
        vocab: BpeVocab,
        chat_template: ChatTemplate,
        eos_token_ids: tuple[int, ...],
        chat_stop_token_ids: tuple[int, ...],
        bos_token_id: int | None = None,
        model_vocab_size: int = 0,
    ) -> None:
        self.name = vocab.name
        self.vocab_size = vocab.vocab_size
        self.model_vocab_size = model_vocab_size  # the model's logits width by its config.json (0: no config)
        self.special_tokens = dict(vocab.special_tokens)
        self.default_allowed_special = vocab.default_allowed_special
        self.eos_token_ids = eos_token_ids  # a plain completion ends at any of these
        self.chat_stop_token_ids = chat_stop_token_ids  # a chat reply ends at any of these
        self.bos_token_id = bos_token_id  # never added by `encode`; chat templates write it themselves
        self.chat_template = chat_template
        self._normalization = vocab.normalization
        self._encoding = tiktoken.Encoding(
            name=vocab.name,
            pat_str=vocab.pat_str,
            mergeable_ranks=vocab.mergeable_ranks,
            special_tokens=vocab.special_tokens,
        )
        self._special_ids = frozenset(vocab.special_tokens.values())
        self._bytes_by_id = _bytes_by_id(vocab)  # [vocab_size], None where no token has the id
        self.max_token_bytes = max(len(token) for token in self._bytes_by_id if token)
        # a code point is at least one UTF-8 byte, so one token stands for at most this many code points of text
        self._max_chars_per_token = self.max_token_bytes * (MAX_CODE_POINTS_COMPOSED if vocab.normalization else 1)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"

    # -- encode ---------------------------------------------------------------------------------------------
    def encode(self, text: str, allowed_special: AllowedSpecial = None) -> list[int]:
        """Token ids of `text`. `allowed_special`: None (default) = special-token text is ordinary text;
        "all"; "default" = the file's `default_allowed_special`; or a set of special-token strings."""
        allowed = self._allowed(allowed_special)
        if self._normalization:
            text = unicodedata.normalize(self._normalization, text)
        try:
            if not allowed:
                return self._encoding.encode_ordinary(text)
            return self._encoding.encode(text, allowed_special=allowed, disallowed_special=())
        except BaseException as exc:  # tiktoken's panic (pyo3's PanicException) is no Exception
            if type(exc).__name__ != "PanicException":
                raise
            raise InvalidInput(f"the tokenizer cannot encode this text ({_why_not_encoded(text)}); shorten "
                               "it") from None

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on `len(self.encode(text))` in O(1), without encoding: refuses an oversized text early."""
        return -(-len(text) // self._max_chars_per_token)

    def encode_ordinary(self, text: str) -> list[int]:
        return self.encode(text)

    def encode_batch(
        self, texts: Sequence[str], allowed_special: AllowedSpecial = None, num_threads: int = 8
    ) -> list[list[int]]:
        """`encode` of each text; tiktoken releases the GIL, so threads run in parallel."""
        if num_threads <= 1 or len(texts) <= 1:
            return [self.encode(text, allowed_special) for text in texts]
        with ThreadPoolExecutor(max_workers=num_threads) as pool:
            return list(pool.map(lambda text: self.encode(text, allowed_special), texts))

    def _allowed(self, allowed_special: AllowedSpecial) -> set[str] | Literal["all"]:
        if allowed_special is None:
            return set()
        if allowed_special == "all":
            return "all"
        if allowed_special == "default":
            return set(self.default_allowed_special)
        if isinstance(allowed_special, str):
            raise InvalidInput(
                f"allowed_special must be None, 'all', 'default' or a set, not {allowed_special!r}"
            )
        unknown = set(allowed_special) - self.special_tokens.keys()
        if unknown:
            raise InvalidInput(f"not special tokens of this vocabulary: {sorted(unknown)}")
        return set(allowed_special)

    # -- decode ---------------------------------------------------------------------------------------------
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of `ids` joined; ids below `vocab_size` that no token uses give b""."""
        ids = list(ids)
        try:
            return self._encoding.decode_bytes(ids)
        except (KeyError, OverflowError, TypeError):
            return b"".join(self.token_bytes(token_id) for token_id in ids)

    def decode(self, ids: Iterable[int]) -> str:
        """UTF-8 text of `ids`; invalid or cut-off byte sequences become U+FFFD."""
        return self.decode_parts([ids])

    def decode_parts(self, parts: Iterable[Iterable[int]]) -> str:
        """`decode` of the ids of `parts` in order, one `decode_bytes` call a part: a caller on a worker thread lets
        others take the interpreter lock between two parts (one call holds it throughout: the gateway's Detokenize)."""
        return b"".join(self.decode_bytes(part) for part in parts).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        if not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
            raise InvalidInput(f"token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})")
        return self._bytes_by_id[token_id] or b""

    def has_token(self, token_id: int) -> bool:
        """Whether some token (regular or special) has this id; padding ids have none."""
        return 0 <= token_id < self.vocab_size and self._bytes_by_id[token_id] is not None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    # -- chat and export ------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a chat; message text never yields special tokens, only the template's markers do."""
        return self.encode_chat_pieces(self.chat_pieces(messages, add_generation_prompt))

    def chat_pieces(self, messages: list[dict], add_generation_prompt: bool = True) -> list[str | int]:
        """A chat rendered and cut for encoding (`ChatTemplate.pieces`); `encode_chat_pieces` finishes it."""
        return self.chat_template.pieces(messages, add_generation_prompt)

    def encode_chat_pieces(self, pieces: list[str | int]) -> list[int]:
        return encode_pieces(pieces, self.encode_ordinary)

    def min_num_chat_tokens(self, pieces: list[str | int]) -> int:
        """A lower bound on `len(self.encode_chat_pieces(pieces))` without encoding (see `min_num_tokens`)."""
        return sum(1 if isinstance(piece, int) else self.min_num_tokens(piece) for piece in pieces)

    def render_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat as text (for logs and debugging; encode with `apply_chat_template`)."""
        return self.chat_template.render(messages, add_generation_prompt)

    def export_vocab(self) -> dict:
        """JSON-ready vocabulary for grammar engines; see `vocab_export`."""
        return export_vocab(self)


def _bytes_by_id(vocab: BpeVocab) -> list[bytes | None]:
    table: list[bytes | None] = [None] * vocab.vocab_size
    for token, token_id in vocab.mergeable_ranks.items():
        table[token_id] = token
    for text, token_id in vocab.special_tokens.items():
        table[token_id] = text.encode("utf-8")
    return table


def _why_not_encoded(text: str) -> str:
    """What made tiktoken give up on `text`: its regex overflows its stack on one run of ~1M whitespace
    characters (900k encode in 0.5 s; QA), which no other limit refuses first."""
    longest = max((len(m.group()) for m in re.finditer(r"\s{1000,}", text)), default=0)
    if longest:
        return f"a run of {longest} whitespace characters"
    return f"{len(text)} characters"
