"""Paths and file writers shared by the tokenizer tests (pytest puts this dir on sys.path)."""

from __future__ import annotations

import base64
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_CODE_DIR = REPO_ROOT / "models" / "tiny-code" / "target"


def write_tiktoken_file(path: Path, ranks: dict[bytes, int]) -> Path:
    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in by_rank))
    return path
