"""The target's hand-encoded Prefill and Verify replies (specdec.rpc.wire) read correctly in another protobuf
implementation: grpcurl (Go) against the real target service over reflection."""

from __future__ import annotations

import base64
import json
import subprocess

import pytest
from repo_paths import TINY

from specdec.serving.service_thread import ServiceThread


@pytest.fixture(scope="module")
def target():
    from target_service.app import serve

    service = ServiceThread(serve, ["serve-target", "--model", str(TINY / "target"), "--port", "0",
                                    "--drain-seconds", "1", "--log-level", "WARNING"]).start()
    yield service
    service.stop()


def _call(grpcurl: str, addr: str, method: str, body: dict) -> dict:
    out = subprocess.run([grpcurl, "-plaintext", "-d", json.dumps(body), addr, f"specdec.v1.TargetService/{method}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _field(d: dict, name: str):
    camel = name.split("_")[0] + "".join(w.title() for w in name.split("_")[1:])
    return d.get(name, d.get(camel))  # json names depend on the grpcurl build


def test_grpcurl_reads_prefill_and_verify_replies(target, grpcurl):
    prompt = [5, 6, 7, 8, 9]
    reply = _call(grpcurl, target.addr, "Prefill", {"request_id": "wire-1", "prompt_ids": prompt,
                                                    "return_features": True})
    feats = reply["features"]
    rows, dim = (int(x) for x in feats["shape"])
    assert _field(reply, "request_id") == "wire-1" and rows == len(prompt) and feats["dtype"] == "float32"
    assert len(base64.b64decode(feats["data"])) == rows * dim * 4
    verified = _call(grpcurl, target.addr, "Verify", {"trees": [{"request_id": "wire-1", "draft_tokens": [9, 10],
                                                                 "parents": [-1, 0]}]})
    result = verified["results"][0]
    n = int(_field(result, "num_feature_rows"))
    assert _field(result, "request_id") == "wire-1" and n == len(result["tokens"]) >= 1
    assert [int(x) for x in verified["features"]["shape"]] == [n, dim]
    _call(grpcurl, target.addr, "Release", {"request_ids": ["wire-1"]})
