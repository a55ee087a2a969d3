"""A draft head that does not fit the target it is pointed at fails at start, naming what does not fit, instead of
starting SERVING and failing every speculative request as the client's fault (INVALID_ARGUMENT)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from repo_paths import TINY

from specdec.serving.service_thread import ServiceThread

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "specdec"))
from core_checkpoints import make_llama_target  # noqa: E402


@pytest.fixture(scope="module")
def shallow_target(tmp_path_factory):
    """A 4-layer target with the tiny pair's vocabulary and width: the EAGLE-3 head reads layer 5 of 8."""
    return make_llama_target(tmp_path_factory.mktemp("t4") / "target", vocab=8192, hidden=384, layers=4, heads=6,
                             kv_heads=2, shard=False)


def _draft(target_addr: str, target_model: Path, head: str, *flags: str) -> ServiceThread:
    from draft_service.app import serve

    return ServiceThread(serve, ["serve-draft", "--model", str(TINY / head), "--target-model", str(target_model),
                                 "--target", target_addr, "--port", "0", "--drain-seconds", "1", *flags])


def test_an_eagle3_head_trained_for_a_deeper_target_fails_at_start(shallow_target):
    from target_service.app import serve

    target = ServiceThread(serve, ["serve-target", "--model", str(shallow_target), "--port", "0"]).start()
    try:
        with pytest.raises(RuntimeError, match=r"reads the target's hidden states at layer 5 .* has 4 layers"):
            _draft(target.addr, shallow_target, "draft-eagle3").start()
        with pytest.raises(RuntimeError, match=r"8 layers\)"):  # --target-model names another target
            _draft(target.addr, TINY / "target", "draft").start()
    finally:
        target.stop()


def test_a_tree_larger_than_the_target_verifies_fails_at_start():
    """65 draft tokens against a target that verifies at most 64 (QA: the draft went SERVING, its warm-up logged a
    warning, and every request failed INVALID_ARGUMENT without a fallback); 64 starts."""
    from target_service.app import serve

    target = ServiceThread(serve, ["serve-target", "--model", str(TINY / "target"), "--port", "0"]).start()
    try:
        tree = ["--num-steps", "3", "--topk", "8", "--num-draft-tokens"]
        with pytest.raises(RuntimeError, match=r"--num-draft-tokens 65: the target at .* at most 64 draft tokens"):
            _draft(target.addr, TINY / "target", "draft", *tree, "65").start()
        _draft(target.addr, TINY / "target", "draft", *tree, "64").start().stop()
    finally:
        target.stop()


def test_a_target_address_that_serves_another_service_is_named_as_such():
    """`--target` given a draft's address (or a gateway's): before, only `start-up failed: target: Method not
    found!` (QA)."""
    from target_service.app import serve

    target = ServiceThread(serve, ["serve-target", "--model", str(TINY / "target"), "--port", "0"]).start()
    draft = _draft(target.addr, TINY / "target", "draft").start()
    try:
        with pytest.raises(RuntimeError, match=rf"--target {draft.addr}: .*does not serve specdec.v1.TargetService"):
            _draft(draft.addr, TINY / "target", "draft").start()
    finally:
        draft.stop()
        target.stop()


def test_a_target_address_that_is_not_grpc_fails_at_once_naming_it(http1_addr):
    """`--target` at an HTTP/1 port (a metrics port, a web server): start-up waited all of --target-wait-seconds
    and then printed gRPC's "Failed parsing HTTP/2" alone (QA). Now it stops at once and says what answered."""
    import time

    started = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"--target {http1_addr}: target: the address answered, but not in "
                                           r"gRPC's HTTP/2: .*metrics-port.*Failed parsing HTTP/2"):
        _draft(http1_addr, TINY / "target", "draft", "--target-wait-seconds", "60").start()
    assert time.monotonic() - started < 30
