"""`specdec accept-eval` on the bundled pair: the JSON it prints, and one-line errors for a bad prompts file or
token map (it printed a traceback for the README's prompts path in a fresh clone: QA)."""

from __future__ import annotations

import json

import pytest
from repo_paths import TINY

from specdec.cli import main as cli_main

BASE = ["accept-eval", "--target", str(TINY / "target"), "--draft", str(TINY / "draft"), "--max-new-tokens", "8",
        "--json"]


def test_accept_eval_prints_tau_and_checks_losslessness(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n    "}) + "\n\n" + json.dumps({"prompt": "import os\n"}))
    assert cli_main([*BASE, "--prompts", str(prompts)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["prompts"] == 2 and result["lossless_checked"] == 2 and result["lossless_mismatches"] == 0
    assert result["tau"] >= 1.0


def test_accept_eval_bad_files_are_one_line_errors(tmp_path, capsys):
    assert cli_main([*BASE, "--prompts", str(tmp_path / "missing.jsonl")]) == 2
    assert "error: --prompts" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n{"text": "y"}\n')
    assert cli_main([*BASE, "--prompts", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and '"prompt"' in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exit_:  # --limit 0 ran every prompt (0 read as no limit, QA)
        cli_main([*BASE, "--prompts", str(bad), "--limit", "0"])
    assert exit_.value.code == 2 and "--limit: 0 is out of range: prompts >= 1" in capsys.readouterr().err
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "x = 1\\n"}\n')
    assert cli_main([*BASE, "--prompts", str(good), "--token-map", str(tmp_path / "none.json")]) == 2
    assert "error: --token-map" in capsys.readouterr().err


@pytest.mark.parametrize(("content", "message"), [(b"", "no prompts in it"), (b"\n\n", "no prompts in it"),
                                                  (b"\xff\xfe\n", "not UTF-8 text")])
def test_accept_eval_empty_or_undecodable_prompts_are_one_line_errors(tmp_path, capsys, content, message):
    """An empty file divided by zero after the models loaded; one not UTF-8 raised UnicodeDecodeError (QA)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(content)
    assert cli_main([*BASE, "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert f"error: --prompts {prompts}: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--batch-size", "--max-prompt-tokens"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_accept_eval_counts_below_one_are_refused(tmp_path, capsys, flag, value):
    """--batch-size 0 was a range() traceback, -1 ran nothing and divided by zero; --max-prompt-tokens 0 kept the
    whole prompt and -3 dropped its first 3 tokens (QA)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x = 1\\n"}\n')
    with pytest.raises(SystemExit) as exit_:
        cli_main([*BASE, "--prompts", str(prompts), flag, value])
    assert exit_.value.code == 2 and f"{flag}: {value} is out of range" in capsys.readouterr().err


def test_output_read_by_a_reader_that_leaves_ends_quietly(tmp_path):
    """`specdec tokenize ... | head -c 1`: a BrokenPipeError traceback and exit 1 before (QA)."""
    import subprocess
    import sys

    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x\n" * 20000)
    cmd = (f"{sys.executable} -m specdec tokenize --tokenizer {TINY / 'target'} - < {text} | head -c 1 >/dev/null; "
           "echo ${PIPESTATUS[0]}")
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "0" and "Traceback" not in done.stderr, done.stderr
