"""Security: TLS on the gateway, mutual TLS gateway -> draft -> target with certificates made here, API keys,
stream limits, and model loading that never runs pickle or a checkpoint's own code."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time

import grpc
import pytest
from reliability_support import (
    GATEWAY_HEALTH,
    SERVING,
    TARGET_HEALTH,
    creds,
    health,
    make_certs,
    start_draft,
    start_gateway,
    start_target,
)
from repo_paths import REPO

from gateway.auth import ApiKeyFile, key_matches
from specdec.errors import ConfigError
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc

KEY = "sk-test-0123456789abcdef"


def tls_flags(certs, prefix: str = "", identity: str = "server") -> list[str]:
    return [f"--{prefix}tls-cert", f"{certs[identity]}.pem", f"--{prefix}tls-key", f"{certs[identity]}.key",
            f"--{prefix}tls-ca", f"{certs['ca']}.pem"]


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# test keys\nsk-other-key\n{KEY}\n")
    target = start_target(*tls_flags(certs))
    draft = start_draft(target.addr.replace("127.0.0.1", "localhost"), *tls_flags(certs),
                        *tls_flags(certs, "target-", "client"))
    gateway = start_gateway(f"localhost:{draft.port}=localhost:{target.port}",
                            extra=(*tls_flags(certs), "--api-key-file", str(keys), "--max-concurrent-streams", "2"))
    deadline = time.monotonic() + 30
    while not gateway_call(f"localhost:{gateway.port}", creds(certs), KEY).models[0].pairs_up:
        assert time.monotonic() < deadline, "the gateway never reached its pair over mutual TLS"
        time.sleep(0.1)
    yield certs, target, draft, gateway
    for s in (gateway, draft, target):
        s.stop()


def gateway_call(addr: str, channel_creds, key: str | None, method="ListModels", request=None):
    metadata = (("authorization", f"Bearer {key}"),) if key is not None else ()
    with grpc.secure_channel(addr, channel_creds) if channel_creds else grpc.insecure_channel(addr) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        result = getattr(stub, method)(request or gateway_pb2.ListModelsRequest(), timeout=30, metadata=metadata)
        return list(result) if method == "Generate" else result


def test_reliability_mutual_tls_end_to_end(secure):
    certs, target, draft, gateway = secure
    addr = f"localhost:{gateway.port}"
    request = gateway_pb2.GatewayServiceGenerateRequest(prompt="def fib(n):", sampling=common_pb2.SamplingParams(
        max_new_tokens=16))
    deadline = time.monotonic() + 20
    while not (msgs := gateway_call(addr, creds(certs), KEY, "Generate", request))[-1].final.speculative:
        assert time.monotonic() < deadline, "the gateway never reached the draft over mutual TLS"
        time.sleep(0.2)  # the gateway's health loop has not seen the draft yet
    assert msgs[-1].final.speculative and msgs[-1].final.completion_tokens >= 1  # client -> gateway -> draft -> target
    assert health(addr, GATEWAY_HEALTH, creds(certs)) == SERVING  # health needs no API key


@pytest.mark.parametrize("who", ["gateway", "draft", "target"])
def test_reliability_tls_refuses_plaintext_strangers_and_unknown_cas(secure, who):
    certs, target, draft, gateway = secure
    port = {"gateway": gateway.port, "draft": draft.port, "target": target.port}[who]
    addr = f"localhost:{port}"
    attempts = {
        "plaintext": None,
        "no client certificate": creds(certs, identity=None),
        "client certificate from another CA": creds(certs, identity="rogue"),
        "server not trusted (other CA)": creds(certs, ca="rogue"),
    }
    for what, channel_creds in attempts.items():
        with grpc.secure_channel(addr, channel_creds) if channel_creds else grpc.insecure_channel(addr) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, what


def test_reliability_draft_without_client_certificate_cannot_reach_the_target(secure):
    certs, target, _, _ = secure
    with pytest.raises(RuntimeError, match="not ready"):
        start_draft(f"localhost:{target.port}", "--target-wait-seconds", "1", "--target-tls-ca", f"{certs['ca']}.pem")


@pytest.mark.parametrize("metadata,why", [
    ((), "no key"),
    ((("authorization", "Bearer sk-wrong"),), "wrong key"),
    ((("authorization", f"Bearer {KEY[:-1]}"),), "a prefix of a key"),
    ((("authorization", f"Bearer {KEY}x"),), "a key plus one character"),
    ((("authorization", KEY),), "no Bearer scheme"),
    ((("authorization", "Basic dXNlcjpwYXNz"),), "another scheme"),
])
def test_reliability_api_key_required(secure, metadata, why):
    certs, _, _, gateway = secure
    with grpc.secure_channel(f"localhost:{gateway.port}", creds(certs)) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        for call in (lambda: stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10, metadata=metadata),
                     lambda: list(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(prompt="x"), timeout=10,
                                                metadata=metadata))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, why
            assert "authorization: Bearer" in err.value.details()
    assert gateway_call(f"localhost:{gateway.port}", creds(certs), KEY).models  # the right key passes


def test_reliability_api_keys_are_checked_by_digest_and_kept_only_as_digests(tmp_path):
    """A presented key's SHA-256 is looked up: no byte-by-byte comparison whose time tells how much of a key was
    right, none that grows with the number of keys (100k keys cost every call ~7 ms, QA), no key in memory."""
    import hashlib

    keys = tuple(f"sk-{i:06d}-{'x' * 24}".encode() for i in range(100_000))
    (tmp_path / "keys.txt").write_bytes(b"\xef\xbb\xbf" + b"\r\n".join(keys) + b"\r\n")  # a BOM, CRLF lines
    digests = ApiKeyFile(tmp_path / "keys.txt").keys()
    assert digests == {hashlib.sha256(k).digest() for k in keys} and not digests & set(keys)
    for presented, expected in ((keys[0], True), (keys[-1], True), (keys[0][:-1], False), (keys[0] + b"x", False)):
        assert key_matches(presented, digests) is expected
    t0 = time.perf_counter()
    for key in keys[:2000]:
        key_matches(key, digests)
    assert (time.perf_counter() - t0) / 2000 < 1e-3


def test_reliability_an_api_key_file_that_is_not_utf8_is_a_clear_error(tmp_path):
    (tmp_path / "keys.txt").write_bytes(b"key-\xff\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8 text \(invalid start byte at byte 4\)"):
        ApiKeyFile(tmp_path / "keys.txt")


def test_reliability_concurrent_stream_limit(secure):
    certs, _, _, gateway = secure
    addr = f"localhost:{gateway.port}"
    long = gateway_pb2.GatewayServiceGenerateRequest(
        prompt="def f():", sampling=common_pb2.SamplingParams(max_new_tokens=400, ignore_eos=True))
    meta = (("authorization", f"Bearer {KEY}"),)
    with grpc.secure_channel(addr, creds(certs)) as ch:
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        held = [stub.Generate(long, timeout=60, metadata=meta) for _ in range(2)]
        for call in held:
            next(iter(call))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(long, timeout=60, metadata=meta))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit 2" in err.value.details()
        for call in held:
            call.cancel()


# ---- weights: safetensors only, no pickle, no checkpoint code --------------------------------------------
class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling would create the sentinel file


def test_reliability_pickle_checkpoint_refused_by_the_cli(tmp_path):
    model = tmp_path / "pickled"
    model.mkdir()
    (model / "config.json").write_text((REPO / "models/tiny-code/target/config.json").read_text())
    sentinel = tmp_path / "pickle-ran"
    (model / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(str(sentinel))))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "specdec", "serve-target", "--model", str(model), "--port", "0"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode != 0
    assert "pickle checkpoints are refused" in out.stderr and "convert them to safetensors" in out.stderr
    assert not sentinel.exists()


def test_reliability_checkpoint_code_never_runs(tmp_path):
    """A config that points at its own modeling code (auto_map, trust_remote_code) loads our Llama; the code
    in the directory is never imported."""
    model = tmp_path / "remote-code"
    model.mkdir()
    for f in (REPO / "models/tiny-code/target").iterdir():
        (model / f.name).symlink_to(f)
    (model / "config.json").unlink()
    cfg = json.loads((REPO / "models/tiny-code/target/config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    cfg["trust_remote_code"] = True
    (model / "config.json").write_text(json.dumps(cfg))
    sentinel = tmp_path / "code-ran"
    (model / "modeling_evil.py").write_text(f"open({str(sentinel)!r}, 'w').close()\n")
    target = start_target("--model", str(model))
    try:
        assert health(target.addr, TARGET_HEALTH) == SERVING
    finally:
        target.stop()
    assert not sentinel.exists()
