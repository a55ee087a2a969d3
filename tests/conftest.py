"""Shared fixtures: the shipped tiny trained pair, its prompts, and random tiny checkpoints made on the fly."""

from __future__ import annotations

import ast
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from repo_paths import REPO, SHARED_PROMPTS, TINY

from specdec.serving import long_lived

PACKAGES = ("specdec", "gateway", "draft_service", "target_service")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# the suite starts and stops dozens of services in this process: none may freeze the others' objects for good
long_lived.enabled = False


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return TINY


@pytest.fixture(scope="session")
def dev_prompts() -> list[str]:
    """Held-out prompts: prompts/dev.jsonl (a copy of ../shared/prompts/dev.jsonl), else openings of this project's
    own functions (real Python code, enough of it for every test's slice)."""
    if SHARED_PROMPTS.is_file():
        return [json.loads(line)["prompt"] for line in SHARED_PROMPTS.read_text().splitlines() if line.strip()]
    return _own_function_openings()


def _own_function_openings(limit: int = 400) -> list[str]:
    """For each documented function of the project's packages (files in sorted order): its source from the
    `def` line to the end of its docstring."""
    prompts = []
    for path in sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") if "/v1/" not in str(p)):
        lines = path.read_text().splitlines(keepends=True)
        for node in ast.walk(ast.parse("".join(lines))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and ast.get_docstring(node):
                doc = node.body[0]
                prompts.append("".join(lines[node.lineno - 1 : doc.end_lineno]).lstrip())
                if len(prompts) == limit:
                    return prompts
    return prompts


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_dir):
    from specdec.tokenizer import load_tokenizer

    return load_tokenizer(tiny_dir / "target")


@pytest.fixture
def http1_addr():
    """HOST:PORT of a plain HTTP/1 server (what a service's --metrics-port or any web server answers with), for
    clients pointed at an address that is not a gRPC port."""
    class Quiet(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
