"""`load_tokenizer(path)`: find the tokenizer file of a model dir (or take the file given), pick its format by
name, and build a `Tokenizer` with the dir's chat template and stop ids.

Search order in a dir: `tokenizer.tok.json` (xtok), `tokenizer.json` (HF byte-level BPE), `*.tiktoken`,
`tokenizer.model`, `original/tokenizer.model` (tiktoken ranks, e.g. Llama-3).
"""

from __future__ import annotations

import logging
from pathlib import Path

from specdec.errors import ConfigError
from specdec.tokenizer.bpe_vocab import BpeVocab
from specdec.tokenizer.chat_template import ChatTemplate, default_chat_template_source
from specdec.tokenizer.hf_format import load_hf_tokenizer_json
from specdec.tokenizer.stop_tokens import find_chat_stop_token_ids, find_eos_token_ids, unknown_turn_ends
from specdec.tokenizer.tiktoken_format import load_tiktoken_file
from specdec.tokenizer.tokenizer import Tokenizer
from specdec.tokenizer.tokenizer_config import TokenizerConfig
from specdec.tokenizer.xtok_format import XTOK_FILE_NAME, load_xtok

log = logging.getLogger(__name__)

SEARCH_ORDER = (XTOK_FILE_NAME, "tokenizer.json", "*.tiktoken", "tokenizer.model", "original/tokenizer.model")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """`path`: a model dir or a tokenizer file. Raises `ConfigError` naming the path and the reason."""
    tokenizer_file = find_tokenizer_file(Path(path))
    config = TokenizerConfig.from_dir(_config_dir(tokenizer_file))
    vocab = load_vocab(tokenizer_file, config)
    return build_tokenizer(vocab, config)


def find_tokenizer_file(path: Path) -> Path:
    if path.is_file():
        return path
    if not path.is_dir():
        raise ConfigError(f"{path}: no such tokenizer file or model directory")
    for pattern in SEARCH_ORDER:
        matches = sorted(path.glob(pattern))
        if matches:
            return matches[0]
    raise ConfigError(f"{path}: no tokenizer file found (looked for {', '.join(SEARCH_ORDER)})")


def load_vocab(tokenizer_file: Path, config: TokenizerConfig) -> BpeVocab:
    name = tokenizer_file.name
    if name.endswith(".tok.json"):
        return load_xtok(tokenizer_file)
    if name.endswith(".json"):
        return load_hf_tokenizer_json(tokenizer_file, config)
    if name.endswith((".tiktoken", ".model")):
        return load_tiktoken_file(tokenizer_file, config)
    raise ConfigError(
        f"{tokenizer_file}: unknown tokenizer format (expected *.tok.json, tokenizer.json, *.tiktoken "
        "or tokenizer.model)"
    )


def build_tokenizer(vocab: BpeVocab, config: TokenizerConfig) -> Tokenizer:
    template_source = config.chat_template or default_chat_template_source()
    variables = {
        name: value
        for name, value in (("bos_token", config.bos_token), ("eos_token", config.eos_token))
        if value
    }
    origin = config.chat_template_origin if config.chat_template else "the default chat template"
    chat_template = ChatTemplate.compile(template_source, vocab.special_tokens, variables, origin=origin or vocab.name)
    missing = unknown_turn_ends(vocab.special_tokens, template_source)
    if missing:
        log.warning("%s: the chat template writes %s, which this vocabulary has no special token for: chats render "
                    "it as plain text and a reply stops only at EOS (give the model a chat_template that fits its "
                    "vocabulary)", vocab.name, ", ".join(missing))
    eos_token_ids = find_eos_token_ids(vocab.special_tokens, config)
    return Tokenizer(
        vocab,
        chat_template,
        eos_token_ids=eos_token_ids,
        chat_stop_token_ids=find_chat_stop_token_ids(vocab.special_tokens, eos_token_ids, template_source),
        bos_token_id=vocab.special_tokens.get(config.bos_token) if config.bos_token else None,
        model_vocab_size=config.model_vocab_size or 0,
    )


def _config_dir(tokenizer_file: Path) -> Path:
    """The model dir whose HF config files describe this tokenizer file (`original/` sits one level down)."""
    parent = tokenizer_file.parent
    return parent.parent if parent.name == "original" else parent
