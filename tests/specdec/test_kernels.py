"""The Triton kernels against the torch code they replace, on CPU through Triton's interpreter (a subprocess, so
the interpreter setting stays out of this process). The same checks run on CUDA in tests/gpu."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is a dev dependency; `pip install -e '.[dev]'` installs it")

CHECKS = Path(__file__).with_name("kernel_checks.py")
ROOT = Path(__file__).resolve().parents[2]


def test_kernels_match_torch_under_interpreter():
    # float32 only: the interpreter truncates float32 -> bfloat16 where GPUs round to nearest even, so the
    # bfloat16 rounding checks run on the GPU (tests/gpu)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(CHECKS), "cpu", "float32"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all kernel checks passed" in proc.stdout
