"""End to end over loopback: the real target, draft and gateway as processes (as `specdec up` starts them).

Short greedy generations of the bundled tiny pair on CPU. The test that kills the draft runs last in this
module, since it takes the shared stack's draft down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from gateway.client import GatewayClient
from gateway.local_stack import StackConfig, temporary_stack
from specdec.v1 import target_pb2, target_pb2_grpc

PROMPTS = ["def fibonacci(n):", 'def bfs(G, source):\n    """Breadth-first search from source."""\n']
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def stack():
    with temporary_stack(StackConfig.free_ports(speculation="always"), timeout_s=240) as running:
        yield running


@pytest.fixture(scope="module")
def client(stack):
    with GatewayClient(stack.gateway_addr, timeout_s=60) as c:
        yield c


@pytest.fixture(scope="module")
def plain_texts(client):
    return [client.complete(p, max_new_tokens=NEW_TOKENS, no_speculation=True)[0] for p in PROMPTS]


def kv_pages_free(stack) -> tuple[int, int]:
    with grpc.insecure_channel(stack.config.addr("target")) as channel:
        info = target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest())
    return info.kv.pages_free, info.kv.pages_total


def test_gateway_e2e_greedy_speculative_text_equals_plain(client, plain_texts):
    for prompt, plain in zip(PROMPTS, plain_texts, strict=True):
        text, stats = client.complete(prompt, max_new_tokens=NEW_TOKENS)
        assert text == plain and text
        assert stats.speculative and stats.tau > 1.0 and stats.completion_tokens <= NEW_TOKENS
        assert stats.finish_reason in ("length", "stop")


def test_gateway_e2e_a_requests_own_smaller_tree(client, plain_texts):
    """The client's `spec`: a tree of 2 drafts gives the same text, never accepting past depth 2; one deeper than
    the draft service's (5 steps) is INVALID_ARGUMENT naming its shape."""
    text, stats = client.complete(PROMPTS[0], max_new_tokens=NEW_TOKENS, spec={"num_draft_tokens": 2})
    assert text == plain_texts[0] and stats.speculative
    assert len(stats.accepted_per_position) <= 2 and stats.tau <= 3.0
    with pytest.raises(grpc.RpcError) as err:
        client.complete(PROMPTS[0], max_new_tokens=4, spec={"num_steps": 6})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_steps=5" in err.value.details()


def test_gateway_e2e_client_sampling_fields(client):
    """min_p, ignore_eos and stop_token_ids reach the engine: a stop id ends the greedy stream at that token's first
    place (the stop token itself included)."""
    whole = client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS, no_speculation=True)
    "".join(whole)
    stop_id = whole.token_ids[3]
    cut = client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS, min_p=0.0, ignore_eos=True, stop_token_ids=[stop_id])
    "".join(cut)
    assert cut.stats.finish_reason == "stop"
    assert cut.token_ids == whole.token_ids[: whole.token_ids.index(stop_id) + 1]


def test_generate_command_takes_the_sampling_and_tree_flags(stack, plain_texts):
    """`specdec generate --num-draft-tokens 2 --top-k 1 --min-p 0` prints the same greedy text as plain decoding;
    a tree larger than the draft's is an error naming its shape (exit 1)."""
    base = [sys.executable, "-m", "specdec", "generate", "--addr", stack.gateway_addr, "--max-new-tokens",
            str(NEW_TOKENS)]
    ok = subprocess.run([*base, "--num-draft-tokens", "2", "--top-k", "1", "--min-p", "0", PROMPTS[0]],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == plain_texts[0] + "\n"
    bad = subprocess.run([*base, "--num-draft-tokens", "99", PROMPTS[0]], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "num_draft_tokens=5" in bad.stderr


def test_generate_command_on_sigterm_is_interrupted_and_its_request_cancelled(stack):
    """SIGTERM to `specdec generate --addr ...` ends it as Ctrl-C does (exit 130, `interrupted`) and the request
    stops on the services (QA: it died of the signal, 143, with no message)."""
    total = wait_all_pages_free(stack)[1]
    proc = subprocess.Popen([sys.executable, "-m", "specdec", "generate", "--addr", stack.gateway_addr,
                             "--max-new-tokens", "1500", PROMPTS[1]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        proc.stdout.read(1)  # text is streaming
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "interrupted" in err, (proc.returncode, err[-500:])
    assert wait_all_pages_free(stack, timeout_s=10) == (total, total)


def test_gateway_e2e_stop_string(client, plain_texts):
    plain = plain_texts[0]
    stop = plain[len(plain) // 2 : len(plain) // 2 + 3]
    text, stats = client.complete(PROMPTS[0], max_new_tokens=NEW_TOKENS, stop=[stop])
    assert text == plain[: plain.index(stop)] and stats.finish_reason == "stop"


def wait_all_pages_free(stack, timeout_s: float = 10.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    while (kv := kv_pages_free(stack))[0] != kv[1] and time.monotonic() < deadline:
        time.sleep(0.1)
    return kv


def test_gateway_e2e_cancel_frees_kv(client, stack):
    free, total = wait_all_pages_free(stack)  # also proves the stop-string request above released its pages
    assert free == total
    stream = client.generate(PROMPTS[1] * 4, max_new_tokens=400, ignore_eos=True)  # runs until cancelled
    next(iter(stream))
    assert kv_pages_free(stack)[0] < total  # the request holds pages while it runs
    stream.cancel()
    assert wait_all_pages_free(stack) == (total, total)


def test_gateway_e2e_leaving_a_stream_loop_early_stops_the_work(client, stack):
    """`for text in stream: ... break`: the client's iterator is closed, and that cancels the call, so the draft
    and the target stop and free the pages (QA: they ran on to max_new_tokens, holding them)."""
    total = wait_all_pages_free(stack)[1]
    stream = client.generate(PROMPTS[1] * 4, max_new_tokens=1500, ignore_eos=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    assert wait_all_pages_free(stack, timeout_s=10) == (total, total)


def test_gateway_e2e_client_side_bad_values_are_invalid_input(client):
    """Values the request message cannot hold fail in the client as `InvalidInput` naming the problem, not as a
    ValueError / KeyError / TypeError from protobuf (QA: `specdec generate --seed -5` printed a traceback)."""
    from specdec.errors import InvalidInput

    for kwargs, named in (({"seed": -5}, "seed -5"), ({"temperature": "hot"}, "temperature 'hot'"),
                          ({"spec": {"bogus": 1}}, "bogus")):
        with pytest.raises(InvalidInput, match="bad request") as err:
            client.generate("x", **kwargs)
        assert named in str(err.value)  # the field is named (QA: `--seed -1` said "Value out of range: -1")
    with pytest.raises(InvalidInput, match="content"):
        client.generate([{"role": "user"}])
    proc = subprocess.run([sys.executable, "-m", "specdec", "generate", "--addr", "127.0.0.1:9", "--seed", "-5", "x"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr.startswith("error: bad request: seed -5")
    assert "Traceback" not in proc.stderr


def test_gateway_e2e_cancels_in_the_first_milliseconds_free_kv_and_ids(client, stack):
    """A client that cancels 0-15 ms after starting (before its request reached the draft's engine, or just
    after) leaves nothing running: every page comes back and the ids can be used again at once. Before, a cancel
    that came while the draft's engine was still adding the request left it running to its length limit."""
    total = wait_all_pages_free(stack)[1]
    ids = [f"early-cancel-{i}" for i in range(10)]
    for i, rid in enumerate(ids):
        stream = client.generate(PROMPTS[1], max_new_tokens=2000, ignore_eos=True, request_id=rid)
        time.sleep(0.005 * (i % 4))
        stream.cancel()
    assert wait_all_pages_free(stack, timeout_s=20) == (total, total)
    for rid in ids:
        text, stats = client.complete(PROMPTS[0], max_new_tokens=2, request_id=rid)
        assert stats.completion_tokens == 2


def test_gateway_e2e_bad_input_statuses(client):
    with pytest.raises(grpc.RpcError) as too_many:
        client.complete("x", max_new_tokens=5000)
    assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the limit 4096" in too_many.value.details()
    with pytest.raises(grpc.RpcError) as empty:
        client.complete("", max_new_tokens=4)
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in empty.value.details()


def test_gateway_e2e_draft_killed_mid_stream_same_text_one_stream(client, stack, plain_texts):
    stream = client.generate(PROMPTS[0], max_new_tokens=NEW_TOKENS)
    chunks = iter(stream)
    first = next(chunks)
    os.kill(stack.process("draft").pid, signal.SIGKILL)
    text = first + "".join(chunks)
    assert text == plain_texts[0]
    assert stream.stats is not None and not stream.stats.speculative
    again, stats = client.complete(PROMPTS[1], max_new_tokens=NEW_TOKENS)  # draft down: served by the target
    assert again == plain_texts[1] and not stats.speculative


def test_gateway_e2e_readme_command_starts_a_local_stack():
    """`specdec generate "def fibonacci(n):"` with nothing running: it starts and stops its own stack."""
    result = subprocess.run(
        [sys.executable, "-m", "specdec", "generate", "--max-new-tokens", "16", "def fibonacci(n):"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip()
    assert "tokens/s" in result.stderr and "16 tokens" in result.stderr
