"""`GatewayStats.time_to_first_token_s`: to the first text, and for a request that sends no text at all, to its
first token ids; over a fake target that makes one token per 0.1 s."""

from __future__ import annotations

from gateway_fakes import STOP, collect, fake_stack, run

from specdec.v1 import common_pb2, gateway_pb2

TOKEN_S = 0.1


def generate(fake_model, model_dir, stop: str):
    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            pairs[0].target.delay_s = TOKEN_S
            request = gateway_pb2.GatewayServiceGenerateRequest(
                prompt="def fib(n):", stop=[stop], no_speculation=True,
                sampling=common_pb2.SamplingParams(max_new_tokens=100))
            return await collect(stub.Generate(request))

    return run(body())


def test_a_request_that_sends_no_text_times_its_first_token(fake_model, model_dir, tiny_tokenizer):
    """A stop string made of the first 4 tokens: their text is held back (it could become the stop string) and
    then cut, so no text is ever sent, but the ids went out one by one. QA: the stat equalled `total_s`; it is
    the time the first token was sent, ~0.1 s, not the ~0.4 s the request took."""
    text, ids, final, _ = generate(fake_model, model_dir, tiny_tokenizer.decode(fake_model.script[:4]))
    assert text == "" and ids == fake_model.script[:4] and final.finish_reason == STOP
    assert final.total_s >= 4 * TOKEN_S and final.time_to_first_token_s < final.total_s - 2 * TOKEN_S


def test_a_stop_string_at_the_first_token_ends_at_its_first_token(fake_model, model_dir, tiny_tokenizer):
    """No text and one token: the first token is the last, so the time to it is the whole request's."""
    text, ids, final, _ = generate(fake_model, model_dir, tiny_tokenizer.decode(fake_model.script[:1]))
    assert text == "" and ids == fake_model.script[:1]
    assert 0 <= final.total_s - final.time_to_first_token_s < 0.05


def test_a_request_with_text_times_its_first_text(fake_model, model_dir):
    """The stop string comes late: text flows from the first token on."""
    text, _, final, _ = generate(fake_model, model_dir, "(n - 2")
    assert text and final.time_to_first_token_s < 2 * TOKEN_S < final.total_s
