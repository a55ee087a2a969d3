"""Load `tokenizer.tok.json`, the "xtok" JSON of Grok-style models.

Layout: `regular_tokens` and `special_tokens` as lists of `{"bytes": [ints], "token": id}`, `word_split`
(`"V1"` = `patterns.XTOK_V1`), optional `pat_str` overriding it, optional `vocab_size`, optional
`default_allowed_special` (a list of byte lists naming special tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.errors import ConfigError
from specdec.tokenizer.bpe_vocab import BpeVocab, max_id_plus_one
from specdec.tokenizer.patterns import XTOK_WORD_SPLITS

XTOK_FILE_NAME = "tokenizer.tok.json"


def load_xtok(path: Path) -> BpeVocab:
    data = _read_json(path)
    try:
        mergeable_ranks = {bytes(item["bytes"]): int(item["token"]) for item in data["regular_tokens"]}
        special_tokens = {_text(path, item["bytes"]): int(item["token"]) for item in data["special_tokens"]}
        default_allowed = frozenset(_text(path, raw) for raw in data.get("default_allowed_special", ()))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: malformed xtok tokenizer ({type(exc).__name__}: {exc})") from exc
    return BpeVocab(
        name=str(path),
        pat_str=data.get("pat_str") or _word_split_pattern(path, data.get("word_split")),
        mergeable_ranks=mergeable_ranks,
        special_tokens=special_tokens,
        vocab_size=int(data.get("vocab_size") or max_id_plus_one(mergeable_ranks, special_tokens)),
        default_allowed_special=default_allowed,
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read tokenizer ({exc})") from exc
    if not isinstance(data, dict) or "regular_tokens" not in data:
        raise ConfigError(f"{path}: not an xtok tokenizer (no 'regular_tokens' list)")
    return data


def _word_split_pattern(path: Path, word_split: object) -> str:
    if word_split not in XTOK_WORD_SPLITS:
        known = ", ".join(sorted(XTOK_WORD_SPLITS))
        raise ConfigError(f"{path}: unknown word_split {word_split!r} (known: {known}; or give 'pat_str')")
    return XTOK_WORD_SPLITS[word_split]


def _text(path: Path, raw: list[int]) -> str:
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: special token {bytes(raw)!r} is not UTF-8") from exc
