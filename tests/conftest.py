"""Shared fixtures: the shipped tiny trained pair, its prompts, and random tiny checkpoints made on the fly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from repo_paths import SHARED_PROMPTS, TINY

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def dev_prompts() -> list[str]:
    """Held-out prompts: ../shared/prompts/dev.jsonl when present, else a few bundled code prompts."""
    if SHARED_PROMPTS.is_file():
        return [json.loads(line)["prompt"] for line in SHARED_PROMPTS.read_text().splitlines() if line.strip()]
    return [
        'def bfs(G, source):\n    """Breadth-first search from source."""\n',
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
        "import os\n\n\ndef list_files(path):\n    \"\"\"Return the files under path.\"\"\"\n",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    ]


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir):
    from specdec.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dir / "target")
