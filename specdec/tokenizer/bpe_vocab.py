"""`BpeVocab`: what every tokenizer file format is loaded into, before a `Tokenizer` is built from it.

All supported formats are byte-level BPE in tiktoken's sense: a token's id is also its merge rank, text is cut
into pieces by `pat_str` and each piece's bytes are merged lowest rank first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.errors import ConfigError


@dataclass(frozen=True)
class BpeVocab:
    name: str  # where it came from (a path), for messages
    pat_str: str
    mergeable_ranks: dict[bytes, int] = field(repr=False)  # token bytes -> id (= rank)
    special_tokens: dict[str, int]  # special token text -> id
    vocab_size: int  # logits width: every id is < vocab_size; ids no token uses decode to b""
    default_allowed_special: frozenset[str] = frozenset()  # specials the file lets plain `encode` produce
    normalization: str | None = None  # a `unicodedata` form applied before encoding ("NFC"), or None

    def __post_init__(self) -> None:
        check_vocab(self)


def check_vocab(vocab: BpeVocab) -> None:
    """Reject vocabularies whose ids collide or exceed `vocab_size`, naming the file and the reason."""
    if not vocab.mergeable_ranks:
        raise ConfigError(f"{vocab.name}: no regular tokens")
    num_bytes = sum(1 for token in vocab.mergeable_ranks if len(token) == 1)
    if num_bytes < 256:
        raise ConfigError(
            f"{vocab.name}: only {num_bytes} of the 256 single-byte tokens; not a byte-level BPE"
        )
    ids = list(vocab.mergeable_ranks.values()) + list(vocab.special_tokens.values())
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{vocab.name}: two tokens share an id")
    if min(ids) < 0 or max(ids) >= vocab.vocab_size:
        raise ConfigError(f"{vocab.name}: token ids must lie in [0, vocab_size={vocab.vocab_size})")
    unknown = vocab.default_allowed_special - set(vocab.special_tokens)
    if unknown:
        raise ConfigError(f"{vocab.name}: default_allowed_special names unknown tokens {sorted(unknown)}")


def max_id_plus_one(mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int]) -> int:
    return max([*mergeable_ranks.values(), *special_tokens.values()]) + 1
