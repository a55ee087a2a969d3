"""Chats that could hurt the gateway or be refused wrongly: very many messages (the event loop), and the chat
template's own stop ids on top of a client's maximum of stop_token_ids; over fake pairs."""

from __future__ import annotations

import asyncio
import time

import pytest
from gateway_fakes import STOP, FakeModel, collect, fake_stack, run, status_of

from gateway import prompts
from gateway.config import MAX_CHAT_MESSAGES
from specdec.rpc.sampling_codec import sampling_from_proto
from specdec.sampling_params import MAX_STOP_TOKEN_IDS
from specdec.tokenizer import Tokenizer
from specdec.v1 import common_pb2, gateway_pb2


def chat_request(num_messages: int, content: str = "a", **sampling) -> gateway_pb2.GatewayServiceGenerateRequest:
    message = gateway_pb2.ChatMessage(role="user", content=content)
    return gateway_pb2.GatewayServiceGenerateRequest(
        chat=gateway_pb2.ChatMessages(messages=[message] * num_messages),
        sampling=common_pb2.SamplingParams(**sampling))


class CountedRoles(tuple):
    """`CHAT_ROLES` that counts the role checks: one per message the gateway reads."""

    checked = 0

    def __contains__(self, role) -> bool:
        CountedRoles.checked += 1
        return tuple.__contains__(self, role)


def test_a_chat_with_too_many_messages_is_refused_before_any_is_read(fake_model, model_dir, monkeypatch):
    """QA: 1M one-character messages (11 MB) took 9.5 s of the event loop to be refused as too long, and a
    ListModels meanwhile 6.7 s (three such). The count is checked first: no message is read, nothing rendered,
    and a ListModels sent meanwhile answers at once. A chat at the limit is read (and here, too long, refused)."""
    monkeypatch.setattr(prompts, "CHAT_ROLES", CountedRoles(prompts.CHAT_ROLES))
    monkeypatch.setattr(CountedRoles, "checked", 0)
    rendered = []
    real_template = Tokenizer.chat_pieces
    monkeypatch.setattr(Tokenizer, "chat_pieces",
                        lambda self, messages, *a: rendered.append(len(messages)) or real_template(self, messages, *a))
    huge = chat_request(200_000)

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            started = time.monotonic()
            refused = asyncio.ensure_future(status_of(stub.Generate(huge)))
            models_started = time.monotonic()
            await stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=5)
            models_s = time.monotonic() - models_started
            code, details = await refused
            refused_s, checked_when_refused = time.monotonic() - started, CountedRoles.checked
            at_limit = await status_of(stub.Generate(chat_request(MAX_CHAT_MESSAGES)))
            return (code, details, refused_s, models_s, checked_when_refused, at_limit,
                    pairs[0].draft.seen.requests)

    code, details, refused_s, models_s, checked, at_limit, downstream = run(body())
    assert code == "INVALID_ARGUMENT"
    assert details == f"chat has 200000 messages; at most {MAX_CHAT_MESSAGES} are allowed"
    assert checked == 0 and rendered == [MAX_CHAT_MESSAGES]  # only the chat at the limit was read and rendered
    assert refused_s < 1.0 and models_s < 0.5
    assert at_limit[0] == "INVALID_ARGUMENT" and "the model's context holds 512" in at_limit[1]
    assert CountedRoles.checked == MAX_CHAT_MESSAGES and not downstream


def test_a_chat_of_many_short_messages_is_encoded_off_the_event_loop(fake_model, model_dir, monkeypatch):
    """The template's work grows with the number of messages, not only with their text: 4096 one-character
    messages (4096 characters, under the 16k that sends a text to a worker thread) took ~20 ms on the event
    loop. With their rendering made to take 1.5 s, a small Generate sent meanwhile answers at once."""
    real_template = Tokenizer.chat_pieces

    def slow_template(self, messages, *args):
        if len(messages) > 1:
            time.sleep(1.5)
        return real_template(self, messages, *args)

    monkeypatch.setattr(Tokenizer, "chat_pieces", slow_template)

    async def body():
        async with fake_stack(fake_model, model_dir) as (_, _, stub):
            slow = asyncio.ensure_future(status_of(stub.Generate(chat_request(MAX_CHAT_MESSAGES))))
            await asyncio.sleep(0.2)  # the chat is being rendered
            started = time.monotonic()
            small = await status_of(stub.Generate(chat_request(1, max_new_tokens=2)))
            return small, time.monotonic() - started, slow.done(), await slow

    small, small_s, slow_done_first, (slow_code, _) = run(body())
    assert small == ("OK", "") and small_s < 0.5 and not slow_done_first
    assert slow_code == "INVALID_ARGUMENT"  # 28k tokens: more than the fakes' 512-token context


class RecordingModel(FakeModel):
    """A fake model that keeps the stop_token_ids each downstream request carried."""

    def __init__(self, script: list[int]) -> None:
        super().__init__(script)
        self.stop_token_ids: list[list[int]] = []

    def plan(self, request_id, prompt_ids, sampling):
        self.stop_token_ids.append(list(sampling.stop_token_ids))
        return super().plan(request_id, prompt_ids, sampling)


@pytest.mark.parametrize("no_speculation", [False, True])
@pytest.mark.parametrize("num_ids", [MAX_STOP_TOKEN_IDS, MAX_STOP_TOKEN_IDS - 1, 0])
def test_a_chat_with_the_most_stop_token_ids_still_stops_at_the_turn_end(tiny_tokenizer, model_dir, no_speculation,
                                                                         num_ids):
    """QA: a chat with the documented maximum of 1024 stop_token_ids was refused ("1026 stop_token_ids"): the
    gateway added the template's two (eos, <|separator|>) and the services refuse more than 1024. The services
    now get the client's ids and as many of the template's as fit (a list they accept), and the gateway itself
    ends the stream at the rest: the reply is the same whatever the client listed, cut at the separator inside
    the draft's 3-token chunk, the tokens past it neither sent nor counted."""
    separator = tiny_tokenizer.special_tokens["<|separator|>"]
    words = tiny_tokenizer.encode(" Hello there, my friend")
    script = [*words[:4], separator, *tiny_tokenizer.encode(" more text" * 10)]
    unused = sorted(set(range(3, tiny_tokenizer.vocab_size)) - set(script))
    model = RecordingModel(script)

    async def body():
        async with fake_stack(model, model_dir) as (pairs, _, stub):
            pairs[0].draft.delay_s = pairs[0].target.delay_s = 0.02  # still generating past the separator
            req = chat_request(1, "hi", max_new_tokens=50, stop_token_ids=unused[:num_ids])
            req.no_speculation = no_speculation
            result = await collect(stub.Generate(req))
            await asyncio.sleep(0.2)
            return result, pairs[0].draft.seen.cancelled + pairs[0].target.seen.cancelled

    (text, ids, final, _), cancelled = run(body())
    assert text == tiny_tokenizer.decode(words[:4]) and ids == script[:5] and ids[-1] == separator
    assert final.finish_reason == STOP and final.completion_tokens == 5
    # the service stopped there itself, or (no room for the separator in its list) the gateway closed its stream
    separator_sent = num_ids + 2 <= MAX_STOP_TOKEN_IDS
    assert cancelled == ([] if separator_sent else [final.request_id])
    (sent,) = model.stop_token_ids
    assert sent[:num_ids] == unused[:num_ids] and len(sent) == min(num_ids + 2, MAX_STOP_TOKEN_IDS)
    sampling_from_proto(common_pb2.SamplingParams(stop_token_ids=sent)).validate(tiny_tokenizer.vocab_size)


def test_a_chats_stop_token_ids_are_counted_as_sent_and_deduplicated_downstream(tiny_tokenizer, model_dir):
    """The limit counts what the client sent (1025 copies of one id: refused, as for a prompt); what goes
    downstream is each id once, the template's included."""
    separator = tiny_tokenizer.special_tokens["<|separator|>"]
    model = RecordingModel([*tiny_tokenizer.encode(" Hi"), separator])

    async def body():
        async with fake_stack(model, model_dir) as (_, _, stub):
            over = await status_of(stub.Generate(chat_request(1, "hi", stop_token_ids=[7] * 1025)))
            at = await status_of(stub.Generate(chat_request(1, "hi", stop_token_ids=[7] * 1024)))
            return over, at

    over, at = run(body())
    assert over == ("INVALID_ARGUMENT", "1025 stop_token_ids; at most 1024 are allowed") and at == ("OK", "")
    assert model.stop_token_ids == [[7, *tiny_tokenizer.chat_stop_token_ids]]
