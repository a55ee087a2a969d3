"""The xtok `tokenizer.tok.json` of the bundled tiny code model, and what the format allows."""

from __future__ import annotations

import json

import pytest

from specdec.errors import ConfigError
from specdec.tokenizer import load_tokenizer


def test_tiny_code_vocabulary(tiny_code):
    assert tiny_code.vocab_size == 8192
    assert tiny_code.special_tokens == {"<|pad|>": 0, "<|separator|>": 1, "<|eos|>": 2}
    assert tiny_code.default_allowed_special == frozenset({"<|eos|>"})
    assert tiny_code.eos_token_ids == (2,)


def test_v1_split_puts_each_digit_in_its_own_token(tiny_code):
    ids = tiny_code.encode("x = 12345")
    assert [tiny_code.decode([i]) for i in ids][-5:] == ["1", "2", "3", "4", "5"]


def test_default_allowed_special_is_honoured_on_request(tiny_code):
    text = "return x<|eos|><|separator|>"
    default_ids = tiny_code.encode(text, allowed_special="default")
    assert 2 in default_ids and 1 not in default_ids  # <|eos|> allowed by the file, <|separator|> not
    assert 2 not in tiny_code.encode(text)  # the safe default never makes specials from text


def _write(tmp_path, data) -> str:
    path = tmp_path / "tokenizer.tok.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_unknown_word_split_is_a_clear_error(xtok_data, tmp_path):
    path = _write(tmp_path, {**xtok_data, "word_split": "V7", "pat_str": None})
    with pytest.raises(ConfigError, match=r"tokenizer\.tok\.json: unknown word_split 'V7'"):
        load_tokenizer(path)


def test_pat_str_overrides_word_split(xtok_data, tmp_path):
    tokenizer = load_tokenizer(_write(tmp_path, {**xtok_data, "word_split": "V7", "pat_str": r"\S+|\s+"}))
    pieces = [tokenizer.decode([i]) for i in tokenizer.encode("def  value")]
    assert "".join(pieces) == "def  value"
    assert "  " in pieces  # V1 would glue one space to the word: "def", " ", " value"


def test_missing_vocab_size_and_default_allowed_special_are_optional(xtok_data, tmp_path):
    data = {
        k: v for k, v in xtok_data.items() if k not in ("vocab_size", "default_allowed_special", "pat_str")
    }
    tokenizer = load_tokenizer(_write(tmp_path, data))
    assert tokenizer.vocab_size == 8192
    assert tokenizer.default_allowed_special == frozenset()
    assert tokenizer.encode("a<|eos|>", allowed_special="default") == tokenizer.encode("a<|eos|>")


def test_explicit_vocab_size_pads_the_vocabulary(xtok_data, tmp_path):
    tokenizer = load_tokenizer(_write(tmp_path, {**xtok_data, "vocab_size": 8200}))
    assert tokenizer.vocab_size == 8200
    assert tokenizer.decode_bytes([8199]) == b""
    assert not tokenizer.has_token(8199)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"regular_tokens": "nope"}, "malformed xtok tokenizer"),
        ({"vocab_size": 100}, "must lie in"),
        (
            {"default_allowed_special": [[60, 124, 110, 111, 124, 62]]},
            "default_allowed_special names unknown",
        ),
        ({"special_tokens": [{"bytes": [60], "token": 3}]}, "share an id"),
    ],
)
def test_broken_files_fail_with_path_and_reason(xtok_data, tmp_path, change, reason):
    path = _write(tmp_path, {**xtok_data, **change})
    with pytest.raises(ConfigError, match=reason) as info:
        load_tokenizer(path)
    assert path in str(info.value)
