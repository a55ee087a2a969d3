"""Tree proposals through lanes (`specdec.engine.draft_tree_graphs`, what the draft's CUDA graphs replay) equal the
eager proposals: `tree_lane_checks.py` on CPU through Triton's interpreter (a subprocess, so the interpreter
setting stays out of this process). The captured graphs run the same checks in tests/gpu."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is a dev dependency; `pip install -e '.[dev]'` installs it")

CHECKS = Path(__file__).with_name("tree_lane_checks.py")
ROOT = Path(__file__).resolve().parents[2]


def test_tree_lanes_equal_eager_proposals_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(CHECKS), "cpu"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all tree lane checks passed" in proc.stdout
