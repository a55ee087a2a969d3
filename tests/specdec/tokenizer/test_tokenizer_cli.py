"""`specdec tokenize` / `specdec detokenize` through the real top-level CLI."""

from __future__ import annotations

import json

from tokenizer_testdata import TINY_CODE_DIR

from specdec.cli import main

TOKENIZER = str(TINY_CODE_DIR)


def test_tokenize_prints_ids_as_json(capsys, tiny_code):
    assert main(["tokenize", "--tokenizer", TOKENIZER, "def f(): pass"]) == 0
    assert json.loads(capsys.readouterr().out) == tiny_code.encode("def f(): pass")


def test_tokenize_special_handling(capsys):
    main(["tokenize", "--tokenizer", TOKENIZER, "x<|eos|>"])
    assert json.loads(capsys.readouterr().out)[-1] == 2  # the file's default_allowed_special
    main(["tokenize", "--tokenizer", TOKENIZER, "--allow-special", "none", "x<|eos|>"])
    assert 2 not in json.loads(capsys.readouterr().out)
    main(["tokenize", "--tokenizer", TOKENIZER, "--chat", "hi"])
    assert json.loads(capsys.readouterr().out).count(1) == 1


def test_detokenize_accepts_json_and_plain_lists(capsys, tiny_code):
    ids = tiny_code.encode("print('héllo')")
    for raw in (json.dumps(ids), " ".join(map(str, ids)), ",".join(map(str, ids))):
        assert main(["detokenize", "--tokenizer", TOKENIZER, raw]) == 0
        assert capsys.readouterr().out == "print('héllo')\n"


def test_detokenize_reads_stdin_for_a_dash(capsys, monkeypatch, tiny_code):
    """As `tokenize -` and `generate -` do (QA: `echo '[331]' | specdec detokenize ... -` said IDS must be ints)."""
    import io

    ids = tiny_code.encode("x = 1")
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(ids) + "\n"))
    assert main(["detokenize", "--tokenizer", TOKENIZER, "-"]) == 0
    assert capsys.readouterr().out == "x = 1\n"


def test_stdin_bytes_that_are_not_utf8_read_as_replacement_characters(capsys, monkeypatch, tiny_code):
    """Python's own reading kept them as lone surrogates, which `specdec generate -` failed to send
    (`UnicodeEncodeError: surrogates not allowed`, QA); `tokenize -` and `generate -` now read the same text."""
    import io

    from specdec.tokenizer.cli import text_arg

    stdin = io.TextIOWrapper(io.BytesIO(b"\xff\xfedef f"), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr("sys.stdin", stdin)
    assert text_arg("-") == "\ufffd\ufffddef f" and text_arg("x") == "x"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xff\xfedef f"), encoding="utf-8",
                                                      errors="surrogateescape"))
    assert main(["tokenize", "--tokenizer", TOKENIZER, "-"]) == 0
    assert json.loads(capsys.readouterr().out) == tiny_code.encode("\ufffd\ufffddef f")


def test_errors_exit_1_with_message(capsys, tmp_path):
    assert main(["detokenize", "--tokenizer", TOKENIZER, "[1, 99999]"]) == 1
    assert "outside the vocabulary" in capsys.readouterr().err
    assert main(["detokenize", "--tokenizer", TOKENIZER, "a b"]) == 1
    assert main(["detokenize", "--tokenizer", TOKENIZER, "[true]"]) == 1  # a JSON boolean is no id (was id 1)
    assert main(["detokenize", "--tokenizer", TOKENIZER, "[1, false]"]) == 1
    assert main(["detokenize", "--tokenizer", TOKENIZER, "[abc"]) == 1  # said "Expecting value: line 1 column 2"
    assert "IDS is not a JSON list of token ids such as [1, 2, 3]: Expecting value at character 2, found 'abc'" \
        in capsys.readouterr().err
    assert main(["tokenize", "--tokenizer", str(tmp_path), "x"]) == 1
    assert "no tokenizer file found" in capsys.readouterr().err


def test_argument_bytes_that_are_not_utf8_read_as_on_stdin():
    """Python decodes argv with surrogateescape: `specdec generate $'def \\xff f'` sent lone surrogates and was refused
    (`--chat`: a traceback), while the same bytes on stdin became U+FFFD (QA). Both read the same now."""
    import os

    from specdec.tokenizer.cli import text_arg

    argv_text = os.fsdecode(b"def \xff f \xc3\xa9")  # what sys.argv holds for those bytes
    assert text_arg(argv_text) == "def \ufffd f \u00e9"
    assert text_arg("caf\u00e9 \U0001f600") == "caf\u00e9 \U0001f600"  # UTF-8 arguments unchanged
    assert text_arg("a\ud800b") == "a\ud800b"  # a caller's own lone surrogate (no argv byte): left to the request
