"""The committed stubs in specdec/v1 are exactly what scripts/gen_proto.sh makes from proto/ today."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STUBS = REPO / "specdec" / "v1"


def test_committed_stubs_match_the_protos(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run(["bash", str(REPO / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True, cwd=REPO)
    fresh = {p.name: p.read_text() for p in (tmp_path / "specdec" / "v1").iterdir()}
    committed = {p.name: p.read_text() for p in STUBS.glob("*_pb2*.py*")}
    assert fresh, "gen_proto.sh generated nothing"
    stale = sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))
    assert not stale, f"stale generated stubs {stale}: run scripts/gen_proto.sh and commit specdec/v1/"
