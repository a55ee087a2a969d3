"""The vocabulary export for grammar engines is JSON-ready and reproduces every token's bytes."""

from __future__ import annotations

import json

from specdec.tokenizer.vocab_export import token_bytes_from_export


def test_export_round_trips_token_bytes_and_stop_ids(tiny_code):
    exported = json.loads(json.dumps(tiny_code.export_vocab()))
    assert exported["format"] == "specdec.vocab.v1"
    assert exported["vocab_size"] == len(exported["token_bytes_hex"]) == 8192
    token_bytes = token_bytes_from_export(exported)
    assert all(token_bytes[i] == tiny_code.token_bytes(i) for i in range(8192))
    assert exported["special_tokens"] == {"<|pad|>": 0, "<|separator|>": 1, "<|eos|>": 2}
    assert exported["eos_token_ids"] == [2]
    assert exported["chat_stop_token_ids"] == [2, 1]
    ids = tiny_code.encode("def f():\n    return 42  # 你好")
    assert b"".join(token_bytes[i] for i in ids) == tiny_code.decode_bytes(ids)


def test_padding_ids_export_as_null(tmp_path, xtok_data):
    from specdec.tokenizer import load_tokenizer

    (tmp_path / "tokenizer.tok.json").write_text(json.dumps({**xtok_data, "vocab_size": 8200}))
    exported = load_tokenizer(tmp_path).export_vocab()
    assert exported["token_bytes_hex"][8192:] == [None] * 8
