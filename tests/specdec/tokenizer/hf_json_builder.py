"""Build HF `tokenizer.json` files for tests: from tiktoken ranks (the way HF converts Llama-3 / Qwen2
vocabularies) or by training a small byte-level BPE with the `tokenizers` library."""

from __future__ import annotations

import json
from pathlib import Path


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (written out here, independent of the loader)."""
    byte_values = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    byte_values += list(range(ord("®"), ord("ÿ") + 1))
    chars = byte_values[:]
    extra = 0
    for b in range(256):
        if b not in byte_values:
            byte_values.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(byte_values, map(chr, chars), strict=True))


_BYTE_TO_CHAR = bytes_to_unicode()


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[list[str]]:
    """Every split (a, b) of a token into two lower-ranked tokens, ordered by the merged token's rank."""
    found = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_rank, right_rank = ranks.get(left), ranks.get(right)
            if left_rank is not None and right_rank is not None and left_rank < rank and right_rank < rank:
                found.append((rank, left_rank, right_rank, left, right))
    found.sort()
    return [[_to_str(left), _to_str(right)] for *_, left, right in found]


def _to_str(token: bytes) -> str:
    to_str = _BYTE_TO_CHAR
    return "".join(to_str[b] for b in token)


def tokenizer_json_from_ranks(
    path: Path, ranks: dict[bytes, int], special_tokens: dict[str, int], pat_str: str
) -> Path:
    data = {
        "version": "1.0",
        "added_tokens": [
            {
                "id": i,
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for s, i in special_tokens.items()
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pat_str}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {_to_str(token): rank for token, rank in ranks.items()},
            "merges": _merges_from_ranks(ranks),
        },
    }
    path.write_text(json.dumps(data, ensure_ascii=False))
    return path


def train_byte_level_bpe(path: Path, texts: list[str], vocab_size: int, pat_str: str) -> Path:
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HfTokenizer

    tokenizer = HfTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pat_str), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return path
