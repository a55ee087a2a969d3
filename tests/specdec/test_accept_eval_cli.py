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
