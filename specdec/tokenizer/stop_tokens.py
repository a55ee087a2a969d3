"""Which token ids end generation: `eos_token_ids` for plain completion, `chat_stop_token_ids` for chat.

A completion ends at the model's end-of-sequence token(s): the model dir's `eos_token_id` (generation_config,
else config), else the vocabulary's well-known eos token. A chat reply also ends at the end of the assistant's
turn: the turn-end marker the chat template writes after every message (`<|separator|>` in the Grok-style
default template, `<|eot_id|>` for Llama-3, `<|im_end|>` for Qwen2).
"""

from __future__ import annotations

from specdec.tokenizer.tokenizer_config import TokenizerConfig

EOS_TOKEN_NAMES = ("<|eos|>", "<|end_of_text|>", "<|endoftext|>", "</s>")
TURN_END_TOKEN_NAMES = ("<|separator|>", "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>")


def find_eos_token_ids(special_tokens: dict[str, int], config: TokenizerConfig) -> tuple[int, ...]:
    if config.eos_token_ids:
        return config.eos_token_ids
    if config.eos_token in special_tokens:
        return (special_tokens[config.eos_token],)
    for name in EOS_TOKEN_NAMES:
        if name in special_tokens:
            return (special_tokens[name],)
    return ()


def find_chat_stop_token_ids(
    special_tokens: dict[str, int], eos_token_ids: tuple[int, ...], chat_template_source: str
) -> tuple[int, ...]:
    """`eos_token_ids` plus every known turn-end special token the template mentions, in that order."""
    turn_ends = [
        special_tokens[name]
        for name in TURN_END_TOKEN_NAMES
        if name in special_tokens and name in chat_template_source
    ]
    return tuple(dict.fromkeys([*eos_token_ids, *turn_ends]))


def unknown_turn_ends(special_tokens: dict[str, int], chat_template_source: str) -> list[str]:
    """Known turn-end markers the template writes that the vocabulary has no special token for: they render as
    plain text, and a chat reply stops only at EOS (the default template over an OpenAI vocabulary)."""
    return [name for name in TURN_END_TOKEN_NAMES if name in chat_template_source and name not in special_tokens]
