"""End to end over loopback: a chat with the documented maximum of stop_token_ids passes the real services' own
check of the list (`SamplingParams.validate` in the target), which the fakes do not run."""

from __future__ import annotations

import grpc
import pytest

from gateway.client import GatewayClient
from gateway.local_stack import StackConfig, temporary_stack
from specdec.sampling_params import MAX_STOP_TOKEN_IDS

CHAT = [{"role": "user", "content": "Write a function that adds two numbers"}]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def client():
    with temporary_stack(StackConfig.free_ports(speculation="always"), timeout_s=240) as running, \
            GatewayClient(running.gateway_addr, timeout_s=60) as c:
        yield c


@pytest.mark.parametrize("no_speculation", [False, True])
def test_a_chat_with_1024_stop_token_ids_runs_as_one_without(client, no_speculation):
    """QA: refused as "1026 stop_token_ids; at most 1024 are allowed" (the template's two ids added, then the
    target's check). Ids the reply never produces: the same reply as without any; one id more is refused."""
    base = client.generate(CHAT, max_new_tokens=NEW_TOKENS, no_speculation=no_speculation)
    base_text = "".join(base)
    ids = [i for i in range(100, 8000) if i not in base.token_ids][:MAX_STOP_TOKEN_IDS]
    stream = client.generate(CHAT, max_new_tokens=NEW_TOKENS, stop_token_ids=ids, no_speculation=no_speculation)
    assert "".join(stream) == base_text and stream.token_ids == base.token_ids
    assert stream.stats.finish_reason == base.stats.finish_reason
    with pytest.raises(grpc.RpcError) as refused:
        client.complete(CHAT, max_new_tokens=NEW_TOKENS, stop_token_ids=[*ids, ids[0]])
    assert refused.value.details() == "1025 stop_token_ids; at most 1024 are allowed"
