"""Generate through the gateway over fake pairs: text, stats, UTF-8 across tokens, stop strings, special tokens."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
from conftest import SCRIPT_TEXT
from gateway_fakes import EOS, LENGTH, STOP, collect, fake_stack, run

from specdec.v1 import common_pb2, gateway_pb2


def request(prompt: str = "def fib(n):", **sampling) -> gateway_pb2.GatewayServiceGenerateRequest:
    return gateway_pb2.GatewayServiceGenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(**sampling))


def test_gateway_streams_text_then_final_stats(fake_model, model_dir, tiny_tokenizer):
    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            text, ids, final, count = await collect(stub.Generate(request(max_new_tokens=100)))
            return pairs, text, ids, final, count

    pairs, text, ids, final, count = run(body())
    assert text == SCRIPT_TEXT  # EOS counted but not rendered
    assert ids == fake_model.script and ids[-1] == EOS
    assert count > 1
    assert final.finish_reason == STOP and final.speculative and final.tau == 3.0
    assert list(final.accepted_per_position) == [5, 4]
    assert final.prompt_tokens == len(tiny_tokenizer.encode("def fib(n):"))
    assert final.completion_tokens == len(fake_model.script)
    assert 0 <= final.time_to_first_token_s <= final.total_s
    assert len(final.request_id) >= 16
    assert [r[0] for r in pairs[0].draft.seen.requests] == [final.request_id]
    assert pairs[0].target.seen.requests == []


def test_gateway_no_speculation_uses_the_target_and_gives_the_same_text(fake_model, model_dir):
    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            req = request(max_new_tokens=100)
            req.no_speculation = True
            req.request_id = "plain-1"
            return pairs, await collect(stub.Generate(req))

    pairs, (text, _, final, _) = run(body())
    assert text == SCRIPT_TEXT
    assert not final.speculative and final.tau == 0 and list(final.accepted_per_position) == []
    assert final.request_id == "plain-1"
    assert pairs[0].draft.seen.requests == [] and pairs[0].target.seen.requests[0][0] == "plain-1"


def test_gateway_utf8_split_across_tokens_arrives_as_whole_characters(fake_model, model_dir, tiny_tokenizer):
    async def body():
        async with fake_stack(fake_model, model_dir) as (_, _, stub):
            req = request(max_new_tokens=100)
            req.no_speculation = True  # one token per chunk: every byte-level split point is exercised
            return [msg.text async for msg in stub.Generate(req)]

    deltas = run(body())
    assert "".join(deltas) == SCRIPT_TEXT
    assert all("\ufffd" not in d for d in deltas)
    emoji_bytes = [i for i in fake_model.script if tiny_tokenizer.token_bytes(i) in (b"\xf0\x9f", b"\x98", b"\x80")]
    assert len(emoji_bytes) == 3  # the emoji really is split over three tokens
    assert any(d.endswith("\U0001f600") or "\U0001f600" in d for d in deltas)


def test_gateway_max_new_tokens_ends_with_length(fake_model, model_dir):
    async def body():
        async with fake_stack(fake_model, model_dir) as (_, _, stub):
            return await collect(stub.Generate(request(max_new_tokens=4)))

    text, ids, final, _ = run(body())
    assert final.finish_reason == LENGTH and final.completion_tokens == 4 and ids == fake_model.script[:4]


def test_gateway_a_character_cut_by_the_length_limit_completes_no_stop_string(fake_model, model_dir,
                                                                               tiny_tokenizer):
    """The limit cuts the emoji after its first byte token: the text ends in U+FFFD, and a stop string ending in
    U+FFFD (copied from such an output) does not cut it nor turn LENGTH into STOP (QA: it cut 12 characters while
    the stream said LENGTH and counted every token)."""
    first = next(k for k, i in enumerate(fake_model.script) if tiny_tokenizer.token_bytes(i) == b"\xf0\x9f")
    limit = first + 1
    shown = tiny_tokenizer.decode(fake_model.script[:limit])
    assert shown.endswith("\ufffd")

    async def body():
        async with fake_stack(fake_model, model_dir) as (_, _, stub):
            req = request(max_new_tokens=limit)
            req.stop.extend([shown[-3:], "\ufffd"])
            return await collect(stub.Generate(req))

    text, ids, final, _ = run(body())
    assert text == shown and final.finish_reason == LENGTH
    assert ids == fake_model.script[:limit] and final.completion_tokens == limit


def test_gateway_stop_string_spanning_tokens_cuts_text_and_cancels_downstream(fake_model, model_dir, tiny_tokenizer):
    stop = "(n - 2"  # spans several tokens
    assert len(tiny_tokenizer.encode(stop)) > 1

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            pairs[0].draft.delay_s = 0.05  # the draft is still generating when the stop string shows up
            req = request(max_new_tokens=100)
            req.stop.extend(["never appears", stop])
            result = await collect(stub.Generate(req))
            for _ in range(40):
                if pairs[0].draft.seen.cancelled:
                    break
                await asyncio.sleep(0.05)
            return pairs, result

    pairs, (text, ids, final, _) = run(body())
    assert text == SCRIPT_TEXT[: SCRIPT_TEXT.index(stop)]
    assert final.finish_reason == STOP
    # the ids (chunks of 3 from the draft) end at the token that completed the stop string, as plain decoding's
    # one-token chunks would: the stats count those
    completes = next(k for k in range(1, len(fake_model.script) + 1)
                     if stop in tiny_tokenizer.decode(fake_model.script[:k]))
    assert ids == fake_model.script[:completes] and final.completion_tokens == completes
    assert pairs[0].draft.seen.cancelled == [final.request_id]  # the draft's stream was closed, freeing its KV


def test_gateway_a_stop_held_for_a_longer_one_ends_the_ids_where_it_completed(fake_model, model_dir, tiny_tokenizer):
    """QA: stops "1\\nX" and "\\n": the text was cut at the "\\n", but the ids and completion_tokens ran on to the
    token read to rule the longer stop (starting a character earlier) out."""
    stop = "(n - 2"
    at = SCRIPT_TEXT.index(stop)
    longer = SCRIPT_TEXT[at - 1] + stop + "\x01never"  # starts a character earlier, never completes

    async def body():
        async with fake_stack(fake_model, model_dir) as (_, _, stub):
            req = request(max_new_tokens=100)
            req.stop.extend([longer, stop])
            return await collect(stub.Generate(req))

    text, ids, final, _ = run(body())
    assert text == SCRIPT_TEXT[:at] and final.finish_reason == STOP
    completes = next(k for k in range(1, len(fake_model.script) + 1)
                     if stop in tiny_tokenizer.decode(fake_model.script[:k]))
    assert ids == fake_model.script[:completes] and final.completion_tokens == completes


def test_gateway_chat_stops_at_the_turn_end_marker_and_hides_it(fake_model, model_dir, tiny_tokenizer):
    separator = tiny_tokenizer.special_tokens["<|separator|>"]
    fake_model.script = [*tiny_tokenizer.encode(" Hello"), separator, *tiny_tokenizer.encode(" more")]

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
            req = gateway_pb2.GatewayServiceGenerateRequest(chat=chat)
            return pairs, await collect(stub.Generate(req))

    pairs, (text, ids, final, _) = run(body())
    assert text == " Hello" and ids[-1] == separator and final.finish_reason == STOP
    assert final.prompt_tokens == len(tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]))


class _EndedContext:
    """A servicer context whose call ended (`ended`) or not before the gateway passes a downstream status on."""

    def __init__(self, ended_before: bool):
        self.ended, self.status = ended_before, []

    def done(self):
        return self.ended

    def cancelled(self):
        return False

    def set_code(self, code):
        self.status.append(code)

    def set_details(self, details):
        self.status.append(details)


def test_a_downstream_status_is_passed_on_unless_the_clients_call_already_ended():
    """QA: an expired client deadline came back from the draft as DEADLINE_EXCEEDED and the gateway's abort of the
    already-ended call failed inside grpc, logged as an unhandled ERROR with a traceback. The status is now set on
    the call (sent as the handler returns), and not at all on an ended call."""
    from gateway.servicer import pass_on

    class Downstream(grpc.aio.AioRpcError):
        def __init__(self):
            super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED, None, None, "Deadline Exceeded")

    ended = _EndedContext(ended_before=True)
    pass_on(ended, Downstream())
    assert ended.status == []
    live = _EndedContext(ended_before=False)
    pass_on(live, Downstream())
    assert live.status == [grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"]
