"""Fixtures of the gateway tests: the tiny model's tokenizer dir and a scripted fake model."""

from __future__ import annotations

import pytest
from gateway_fakes import EOS, FakeModel

# Crosses several chunk boundaries; the last line has 2-, 3- and 4-byte UTF-8 characters split over byte tokens.
SCRIPT_TEXT = "    return fib(n - 1) + fib(n - 2)\n\n# caf\u00e9 \u20ac \U0001f600 done"


@pytest.fixture
def model_dir(tiny_dir) -> str:
    return str(tiny_dir / "target")


@pytest.fixture
def fake_model(tiny_tokenizer) -> FakeModel:
    return FakeModel([*tiny_tokenizer.encode(SCRIPT_TEXT), EOS])
