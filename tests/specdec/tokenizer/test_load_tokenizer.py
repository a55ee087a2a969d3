"""Model dir detection picks the format; a missing, unknown or broken file fails with the path and reason."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizer_testdata import TINY_CODE_DIR

from specdec.errors import ConfigError
from specdec.tokenizer import Tokenizer, load_tokenizer


def test_model_dir_and_file_give_the_same_tokenizer(tiny_code):
    from_file = load_tokenizer(str(TINY_CODE_DIR / "tokenizer.tok.json"))
    assert isinstance(from_file, Tokenizer)
    assert from_file.encode("x = [1, 2]") == tiny_code.encode("x = [1, 2]")
    assert from_file.eos_token_ids == tiny_code.eos_token_ids == (2,)


def test_xtok_is_preferred_over_other_files(tmp_path, openai_dir):
    shutil.copy(TINY_CODE_DIR / "tokenizer.tok.json", tmp_path)
    shutil.copy(openai_dir / "cl100k_base.tiktoken", tmp_path)
    assert load_tokenizer(tmp_path).vocab_size == 8192
    (tmp_path / "tokenizer.tok.json").unlink()
    assert load_tokenizer(tmp_path).vocab_size == 100277


def test_missing_path(tmp_path):
    with pytest.raises(ConfigError, match="no such tokenizer file or model directory"):
        load_tokenizer(tmp_path / "nope")


def test_dir_without_tokenizer_lists_what_was_looked_for(tmp_path):
    with pytest.raises(ConfigError, match=r"no tokenizer file found \(looked for tokenizer\.tok\.json"):
        load_tokenizer(tmp_path)


def test_unknown_file_type(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("hello")
    with pytest.raises(ConfigError, match=r"vocab\.txt: unknown tokenizer format"):
        load_tokenizer(path)


def test_broken_json_names_the_file(tmp_path):
    (tmp_path / "tokenizer.tok.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"tokenizer\.tok\.json: cannot read tokenizer"):
        load_tokenizer(tmp_path)


def test_broken_config_file_names_the_file(tmp_path):
    shutil.copy(TINY_CODE_DIR / "tokenizer.tok.json", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match=r"generation_config\.json: expected a JSON object"):
        load_tokenizer(tmp_path)


def test_a_chat_template_marker_the_vocabulary_lacks_is_warned_about(tmp_path, openai_dir, caplog):
    """The default (Grok-style) template over cl100k_base: `<|separator|>` is no special token there, so chats
    render it as text and replies stop only at EOS; loading says so (QA: silently). The tiny model's own
    vocabulary has it: no warning."""
    import logging

    shutil.copy(openai_dir / "cl100k_base.tiktoken", tmp_path)
    with caplog.at_level(logging.WARNING, logger="specdec.tokenizer.load"):
        tok = load_tokenizer(tmp_path)
    assert tok.chat_stop_token_ids == tok.eos_token_ids
    assert any("<|separator|>" in r.getMessage() and "plain text" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specdec.tokenizer.load"):
        load_tokenizer(TINY_CODE_DIR)
    assert not caplog.records
