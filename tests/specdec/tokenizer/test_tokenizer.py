"""`Tokenizer` behaviour on the bundled tiny code model: round trips, special tokens, batching, decoding."""

from __future__ import annotations

import pytest
from tokenizer_corpus import CORPUS, SPECIAL_LOOKING

from specdec.errors import InvalidInput


def test_round_trip_multilingual_text_and_code(tiny_code):
    for text in CORPUS:
        ids = tiny_code.encode(text)
        assert tiny_code.decode(ids) == text
        assert all(0 <= i < tiny_code.vocab_size for i in ids)


def test_byte_level_round_trip_of_unusual_strings(tiny_code):
    for text in ["", "\x00\x01\x7f", "a\u0301", "\ud7ff\ue000\U0010ffff", " " * 50, "\n" * 7 + "x"]:
        assert tiny_code.decode(tiny_code.encode(text)) == text


def test_special_token_text_is_ordinary_text_by_default(tiny_code):
    for text in SPECIAL_LOOKING:
        ids = tiny_code.encode(text)  # never raises, never yields a special id
        assert not any(tiny_code.is_special(i) for i in ids)
        assert tiny_code.decode(ids) == text


def test_allowed_special_all_and_sets(tiny_code):
    text = "a<|separator|>b<|eos|>"
    assert tiny_code.encode(text, allowed_special="all").count(1) == 1
    only_eos = tiny_code.encode(text, allowed_special={"<|eos|>"})
    assert only_eos[-1] == 2 and 1 not in only_eos
    with pytest.raises(InvalidInput, match="not special tokens"):
        tiny_code.encode(text, allowed_special={"<|bogus|>"})
    with pytest.raises(InvalidInput, match="allowed_special must be"):
        tiny_code.encode(text, allowed_special="none")


def test_encode_batch_equals_encode(tiny_code):
    texts = CORPUS * 4
    expected = [tiny_code.encode(text) for text in texts]
    assert tiny_code.encode_batch(texts, num_threads=4) == expected
    assert tiny_code.encode_batch(texts, num_threads=1) == expected
    assert tiny_code.encode_batch([]) == []


def test_decode_replaces_invalid_utf8_and_decode_bytes_is_exact(tiny_code):
    ids = tiny_code.encode("你")  # three byte tokens in this small vocabulary
    assert [tiny_code.token_bytes(i) for i in ids] == [b"\xe4", b"\xbd", b"\xa0"]
    assert tiny_code.decode_bytes(ids[:2]) == b"\xe4\xbd"
    assert tiny_code.decode(ids[:2]) == "\ufffd"
    assert tiny_code.decode(ids[1:] + ids) == "\ufffd\ufffd你"


def test_token_bytes_and_unknown_ids(tiny_code):
    assert tiny_code.token_bytes(2) == b"<|eos|>"
    assert tiny_code.decode([2]) == "<|eos|>"
    for bad in (-1, 8192, 10**12):
        with pytest.raises(InvalidInput, match="outside the vocabulary"):
            tiny_code.decode([bad])
