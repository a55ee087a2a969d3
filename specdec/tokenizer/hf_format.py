"""Convert an HF `tokenizer.json` byte-level BPE (Llama-3 / Qwen2 / GPT-2 style) to tiktoken ranks.

tiktoken merges the adjacent pair whose *concatenation* has the lowest id; HF merges the pair listed earliest
in `merges`. The two agree when token ids follow merge order and each token's bytes, merged by lower ids alone,
come to a pair a merge lists for it (tiktoken would otherwise build it from a split HF never merges: QA); both
hold for vocabularies made by tiktoken (Llama-3, Qwen2) and by the `tokenizers` BPE trainer, and the
loader checks both and refuses files where either fails (~1 s per 100k merges). Added tokens (`added_tokens`)
become special tokens; options that change how text around them or within words is split (`lstrip`, `rstrip`,
`single_word`, BPE `dropout`) are refused.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from specdec.errors import ConfigError
from specdec.tokenizer.bpe_vocab import BpeVocab, max_id_plus_one
from specdec.tokenizer.patterns import GPT2
from specdec.tokenizer.tokenizer_config import TokenizerConfig

SUPPORTED_NORMALIZERS = {None: None, "NFC": "NFC"}


def load_hf_tokenizer_json(path: Path, config: TokenizerConfig) -> BpeVocab:
    data = _read_json(path)
    model = data["model"]
    added = data.get("added_tokens") or ()
    for item in added:
        options = [o for o in ("lstrip", "rstrip", "single_word") if item.get(o)]
        if options:
            raise ConfigError(f"{path}: added token {item.get('content')!r} sets {', '.join(options)}, which is not "
                              "supported (the text around it would be split otherwise than transformers does)")
    special_tokens = {item["content"]: int(item["id"]) for item in added}
    mergeable_ranks = _byte_vocab(path, model["vocab"], exclude=set(special_tokens))
    _check_merge_order(path, model["merges"], mergeable_ranks)
    vocab_size = max_id_plus_one(mergeable_ranks, special_tokens)
    return BpeVocab(
        name=str(path),
        pat_str=_split_pattern(path, data.get("pre_tokenizer")),
        mergeable_ranks=mergeable_ranks,
        special_tokens=special_tokens,
        vocab_size=max(vocab_size, config.model_vocab_size or 0),
        normalization=_normalization(path, data.get("normalizer")),
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read tokenizer ({exc})") from exc
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or "merges" not in model:
        kind = model.get("type") if isinstance(model, dict) else None
        raise ConfigError(f"{path}: model type {kind!r} is not supported; only byte-level BPE is")
    if model.get("dropout"):
        raise ConfigError(f"{path}: BPE dropout {model['dropout']!r} is not supported (encoding would be random)")
    if (
        model.get("byte_fallback")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
    ):
        raise ConfigError(
            f"{path}: SentencePiece-style BPE options are not supported; only byte-level BPE is"
        )
    return data


@cache
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: the printable character HF uses for each byte -> that byte."""
    byte_values = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    char_codes = list(byte_values)  # printable bytes stand for themselves
    others = [byte for byte in range(256) if byte not in byte_values]
    byte_values += others
    char_codes += [256 + index for index in range(len(others))]  # the rest map to 256, 257, ... in byte order
    return {chr(code): byte for byte, code in zip(byte_values, char_codes, strict=True)}


def _to_bytes(path: Path, token: str) -> bytes:
    alphabet = byte_level_alphabet()
    try:
        return bytes(alphabet[char] for char in token)
    except KeyError as exc:
        raise ConfigError(f"{path}: token {token!r} is not byte-level BPE (character {exc} )") from exc


def _byte_vocab(path: Path, vocab: dict[str, int], exclude: set[str]) -> dict[bytes, int]:
    return {
        _to_bytes(path, token): int(token_id) for token, token_id in vocab.items() if token not in exclude
    }


def _merge_pair(merge: str | list[str]) -> tuple[str, str]:
    if isinstance(merge, str):
        left, right = merge.split(" ")
        return left, right
    return merge[0], merge[1]


def _check_merge_order(path: Path, merges: list, mergeable_ranks: dict[bytes, int]) -> None:
    """tiktoken uses ids as merge ranks: each merge's result id must not precede an earlier merge's, and each
    token's ranked split must be one a merge lists (module docstring)."""
    last_id = -1
    splits: dict[bytes, list[tuple[bytes, bytes]]] = {}  # token -> the (left, right) merges that make it
    for index, merge in enumerate(merges):
        left, right = _merge_pair(merge)
        pair = (_to_bytes(path, left), _to_bytes(path, right))
        merged = pair[0] + pair[1]
        merged_id = mergeable_ranks.get(merged)
        if merged_id is None:
            raise ConfigError(f"{path}: merge {index} ({left!r}, {right!r}) makes a token not in the vocab")
        if merged_id < last_id:
            raise ConfigError(
                f"{path}: token ids do not follow merge order (merge {index} makes id {merged_id} after id "
                f"{last_id}); it cannot be run as tiktoken ranks"
            )
        last_id = merged_id
        splits.setdefault(merged, []).append(pair)
    for merged, pairs in splits.items():  # a token may be listed with several splits (ids as ranks allow all)
        built = _ranked_split(merged, mergeable_ranks[merged], mergeable_ranks)
        if tuple(built) not in pairs:
            raise ConfigError(
                f"{path}: token {merged!r} is merged from {pairs[0]!r} but ids as ranks would build it from "
                f"{tuple(built)!r}, which no merge lists; it cannot be run as tiktoken ranks"
            )


def _ranked_split(token: bytes, rank: int, ranks: dict[bytes, int]) -> list[bytes]:
    """The parts tiktoken's merging leaves of `token`'s bytes using only ids below `rank` (lowest id first)."""
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def _split_pattern(path: Path, pre_tokenizer: dict | None) -> str:
    steps = _flatten(pre_tokenizer)
    kinds = [step.get("type") for step in steps]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        byte_level = steps[0]
        pat_str = GPT2
    elif kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        split, byte_level = steps
        if (
            split.get("behavior") != "Isolated"
            or split.get("invert")
            or "Regex" not in split.get("pattern", {})
        ):
            raise ConfigError(
                f"{path}: only an isolating regex Split pre-tokenizer is supported, got {split}"
            )
        pat_str = split["pattern"]["Regex"]
    else:
        raise ConfigError(
            f"{path}: pre-tokenizer {kinds} is not supported (need [ByteLevel] or [Split, ByteLevel])"
        )
    if byte_level.get("add_prefix_space"):
        raise ConfigError(f"{path}: ByteLevel add_prefix_space=true is not supported")
    return pat_str


def _flatten(pre_tokenizer: dict | None) -> list[dict]:
    if pre_tokenizer is None:
        return []
    if pre_tokenizer.get("type") == "Sequence":
        return [step for inner in pre_tokenizer["pretokenizers"] for step in _flatten(inner)]
    return [pre_tokenizer]


def _normalization(path: Path, normalizer: dict | None) -> str | None:
    kind = normalizer.get("type") if normalizer else None
    if kind not in SUPPORTED_NORMALIZERS:
        raise ConfigError(f"{path}: normalizer {kind!r} is not supported (supported: none, NFC)")
    return SUPPORTED_NORMALIZERS[kind]
