"""Paths the tests share (importable from any test module: pytest puts tests/ on sys.path via its conftest)."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny-code"
SHARED_PROMPTS = REPO / "prompts" / "dev.jsonl"  # a copy of ../shared/prompts/dev.jsonl (held-out networkx prompts)
