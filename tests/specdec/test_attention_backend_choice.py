"""`--attention-backend`: a backend that cannot run here stops start-up like any other bad flag (ConfigError: the
service's `start-up failed: ...` line, exit 2), before any weights load. QA: `--attention-backend flashinfer`
without the flashinfer package exited 1 with a `ModuleNotFoundError` traceback after loading the model."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from repo_paths import REPO, TINY

from specdec.attention import check_backend, flashinfer_backend
from specdec.engine.factory import EngineOptions
from specdec.errors import ConfigError

NO_FLASHINFER = importlib.util.find_spec("flashinfer") is None


def _no_flashinfer():
    raise ModuleNotFoundError("No module named 'flashinfer'", name="flashinfer")


def _missing_flashinfer_message_ok(message: str) -> None:
    assert "--attention-backend flashinfer" in message and "No module named 'flashinfer'" in message
    assert "pip install -e '.[gpu]'" in message and "--attention-backend torch" in message


def test_missing_flashinfer_is_a_config_error_naming_the_flag_the_extra_and_torch(monkeypatch):
    monkeypatch.setattr(flashinfer_backend, "import_flashinfer", _no_flashinfer)  # as on a machine without it
    with pytest.raises(ConfigError) as err:
        check_backend("flashinfer")
    _missing_flashinfer_message_ok(str(err.value))
    with pytest.raises(ConfigError) as err:  # the services' start-up check, before any weights load
        EngineOptions(attention_backend="flashinfer").validate()
    _missing_flashinfer_message_ok(str(err.value))
    EngineOptions(attention_backend="torch").validate()  # torch needs nothing more


def test_flashinfer_on_a_cpu_and_unknown_backends_are_config_errors(monkeypatch):
    monkeypatch.setattr(flashinfer_backend, "import_flashinfer", lambda: None)  # as if it were installed
    with pytest.raises(ConfigError, match="needs a CUDA device.*--attention-backend torch runs on a CPU"):
        EngineOptions(attention_backend="flashinfer", device="cpu").validate()
    with pytest.raises(ConfigError, match="unknown --attention-backend 'triton'; supported: flashinfer, torch"):
        EngineOptions(attention_backend="triton").validate()


@pytest.mark.skipif(not NO_FLASHINFER, reason="flashinfer is installed here")
def test_serve_target_without_flashinfer_fails_start_up_with_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "specdec", "serve-target", "--model", str(TINY / "target"), "--port", "62997",
         "--attention-backend", "flashinfer"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "loaded" not in proc.stderr  # refused before the weights load
    assert "start-up failed: --attention-backend flashinfer" in proc.stderr
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1, proc.stderr
    _missing_flashinfer_message_ok(error[0])
