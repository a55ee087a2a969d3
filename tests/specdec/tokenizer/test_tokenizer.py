"""`Tokenizer` behaviour on the bundled tiny code model: round trips, special tokens, batching, decoding."""

from __future__ import annotations

import dataclasses
import sys
import unicodedata

import pytest
from tokenizer_corpus import CORPUS, SPECIAL_LOOKING
from tokenizer_testdata import TINY_CODE_DIR

from specdec.errors import InvalidInput
from specdec.tokenizer.load import find_tokenizer_file, load_vocab
from specdec.tokenizer.tokenizer import MAX_CODE_POINTS_COMPOSED, Tokenizer
from specdec.tokenizer.tokenizer_config import TokenizerConfig


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


def test_min_num_tokens_is_a_lower_bound_even_for_the_longest_tokens(tiny_code):
    """`min_num_tokens` (what the gateway refuses a huge prompt by, untokenized) never exceeds the real count,
    even for text made of the vocabulary's longest token (here 32 emoji in 128 bytes)."""
    longest = next(t for t in map(tiny_code.token_bytes, range(tiny_code.vocab_size))
                   if len(t) == tiny_code.max_token_bytes).decode()
    for text in [*CORPUS, *SPECIAL_LOOKING, "", "a\u0301", "\U0010ffff" * 9, " " * 5000, longest * 40]:
        assert tiny_code.min_num_tokens(text) <= len(tiny_code.encode(text))
    assert tiny_code.min_num_tokens("x" * (128 * 1000 + 1)) == 1001


def test_min_num_tokens_allows_for_normalization_folding_code_points(tiny_code):
    """NFC folds up to 4 code points into one (alpha + 3 marks -> U+1F82): a normalizing vocabulary's bound counts
    4 times fewer tokens, and 4 is indeed Unicode's longest canonical decomposition."""
    vocab = dataclasses.replace(load_vocab(find_tokenizer_file(TINY_CODE_DIR), TokenizerConfig.from_dir(TINY_CODE_DIR)),
                                normalization="NFC")
    nfc = Tokenizer(vocab, tiny_code.chat_template, tiny_code.eos_token_ids, tiny_code.chat_stop_token_ids)
    folded = unicodedata.normalize("NFD", "\u1f82") * 500
    assert len(unicodedata.normalize("NFC", folded)) * 4 == len(folded)
    assert nfc.min_num_tokens(folded) <= len(nfc.encode(folded))
    assert max(len(unicodedata.normalize("NFD", chr(c))) for c in range(sys.maxunicode + 1)
               if not 0xD800 <= c < 0xE000) == MAX_CODE_POINTS_COMPOSED
