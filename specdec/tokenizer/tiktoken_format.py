"""Load a tiktoken BPE file: `*.tiktoken` or Llama-3's `original/tokenizer.model`.

Each line is `base64(token bytes) rank`. The file holds no special tokens and no split pattern; they come from
the model dir's `tokenizer_config.json` (`added_tokens_decoder`, `pat_str`), else from what is publicly known
about the file (`cl100k_base`, `o200k_base`, Llama-3's 128000 ranks).
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from specdec.errors import ConfigError
from specdec.tokenizer.bpe_vocab import BpeVocab, max_id_plus_one
from specdec.tokenizer.patterns import (
    KNOWN_TIKTOKEN_FILES,
    LLAMA3,
    LLAMA3_NUM_RANKS,
    llama3_special_tokens,
)
from specdec.tokenizer.tokenizer_config import TokenizerConfig


def load_tiktoken_file(path: Path, config: TokenizerConfig) -> BpeVocab:
    mergeable_ranks = read_tiktoken_ranks(path)
    known_pat_str, known_specials = _known_defaults(path, len(mergeable_ranks))
    special_tokens = _special_tokens(config, mergeable_ranks) or known_specials
    pat_str = config.pat_str or known_pat_str
    if pat_str is None:
        raise ConfigError(
            f"{path}: no split pattern known for this vocabulary; add 'pat_str' to tokenizer_config.json"
        )
    vocab_size = max_id_plus_one(mergeable_ranks, special_tokens)
    return BpeVocab(
        name=str(path),
        pat_str=pat_str,
        mergeable_ranks=mergeable_ranks,
        special_tokens=special_tokens,
        vocab_size=max(vocab_size, config.model_vocab_size or 0),
    )


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from exc
    ranks = {}
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as exc:
            raise ConfigError(
                f"{path}:{line_number}: not a tiktoken 'base64 rank' line ({exc}); SentencePiece models are "
                "not supported"
            ) from exc
    return ranks


def _known_defaults(path: Path, num_ranks: int) -> tuple[str | None, dict[str, int]]:
    stem = path.name.removesuffix(".tiktoken")
    if stem in KNOWN_TIKTOKEN_FILES:
        pat_str, specials = KNOWN_TIKTOKEN_FILES[stem]
        return pat_str, dict(specials)
    if num_ranks == LLAMA3_NUM_RANKS:
        return LLAMA3, llama3_special_tokens()
    return None, {}


def _special_tokens(config: TokenizerConfig, mergeable_ranks: dict[bytes, int]) -> dict[str, int]:
    """The config's added tokens that are not already regular tokens of the file."""
    regular_ids = set(mergeable_ranks.values())
    return {text: token_id for text, token_id in config.added_tokens.items() if token_id not in regular_ids}
