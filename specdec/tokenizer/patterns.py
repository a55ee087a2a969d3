"""Pre-tokenizer split patterns (regexes in tiktoken's `fancy-regex` dialect), one name per known vocabulary.

A BPE vocabulary is only correct together with the pattern it was trained with: the pattern cuts text into
pieces and BPE merges bytes inside each piece only.
"""

from __future__ import annotations

# xtok `word_split: "V1"` (Grok-style `tokenizer.tok.json`): like cl100k, but digits are split one by one.
XTOK_V1 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama-3 `original/tokenizer.model` (and the regex in its HF `tokenizer.json`).
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CL100K = (
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"
    r"|\s++$|\s*[\r\n]|\s+(?!\S)|\s"
)

O200K = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# GPT-2 / r50k: the pattern HF's `ByteLevel(use_regex=True)` pre-tokenizer applies.
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# xtok `word_split` names -> pattern.
XTOK_WORD_SPLITS = {"V1": XTOK_V1}

# `.tiktoken` file stems whose pattern and special tokens are public knowledge.
KNOWN_TIKTOKEN_FILES = {
    "cl100k_base": (
        CL100K,
        {
            "<|endoftext|>": 100257,
            "<|fim_prefix|>": 100258,
            "<|fim_middle|>": 100259,
            "<|fim_suffix|>": 100260,
            "<|endofprompt|>": 100276,
        },
    ),
    "o200k_base": (O200K, {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}),
}

# Number of BPE ranks in Llama-3's `tokenizer.model`; its 256 special tokens follow them.
LLAMA3_NUM_RANKS = 128000


def llama3_special_tokens() -> dict[str, int]:
    """The special tokens Meta's Llama-3 code appends after the 128000 ranks (ids 128000..128255)."""
    named = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|step_id|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    num_reserved = 256 - len(named)
    names = named + [f"<|reserved_special_token_{2 + i}|>" for i in range(num_reserved)]
    return {name: LLAMA3_NUM_RANKS + i for i, name in enumerate(names)}
