"""Inputs that could hurt the gateway rather than just be wrong: huge prompts (the event loop), raw request ids
in the logs, ids posing as warm-up traffic, and `spec` checked on every route; over fake pairs."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import types

import grpc
import grpc.aio
import pytest
from gateway_fakes import collect, fake_stack, hanging_stream, run, status_of
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.prompts import OFF_LOOP_MIN_CHARS
from gateway.router import Part
from specdec.telemetry.logs import TEXT_FORMAT, ContextFilter
from specdec.tokenizer import Tokenizer
from specdec.v1 import common_pb2, gateway_pb2

# Python source, as a prompt: ~4.4 characters a token with the tiny vocabulary
SOURCE_LINE = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"



async def health_check_s(port: int) -> float:
    """Seconds a health Check of the gateway takes to answer."""
    started = time.monotonic()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return time.monotonic() - started


def test_a_huge_prompt_is_refused_untokenized_while_health_checks_answer(fake_model, model_dir, monkeypatch):
    """50 MB of text cannot fit a 512-token context (a token covers at most 128 bytes here): refused from its
    length alone, fast, while the gateway keeps answering health checks. Before, the whole text was tokenized on
    the event loop first (seconds, the health check waiting). (--max-input-chars raised past it: by default that
    limit, checked first, refuses such a text.)"""
    from gateway.config import GatewayLimits

    encoded = []
    real_encode = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, *a: encoded.append(len(text)) or real_encode(
        self, text, *a))
    huge = SOURCE_LINE * (50_000_000 // len(SOURCE_LINE))

    async def body():
        async with fake_stack(fake_model, model_dir, limits=GatewayLimits(max_input_chars=10**8)) as (
                pairs, gateway, stub):
            started = time.monotonic()
            refused = asyncio.ensure_future(status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                prompt=huge))))
            await asyncio.sleep(0.05)  # the request is on its way in
            health_s = await health_check_s(gateway.port)
            code, details = await refused
            return code, details, time.monotonic() - started, health_s, pairs[0].draft.seen.requests

    code, details, refused_s, health_s, downstream = run(body())
    assert code == "INVALID_ARGUMENT" and details.startswith(f"the prompt has at least {-(-len(huge) // 128)} tokens")
    assert "the model's context holds 512" in details and not downstream
    assert max(encoded, default=0) < 1000  # the huge text itself was never tokenized
    assert refused_s < 3.0 and health_s < 1.0


def test_a_huge_chat_is_refused_before_its_text_is_encoded(fake_model, model_dir, monkeypatch):
    """A chat's least number of tokens is counted once the template has rendered it, before any of it is encoded:
    one message of 4 M characters (under --max-input-chars) was encoded whole (~2 M ids, seconds of CPU) before
    its length was refused (QA)."""
    from gateway.config import GatewayLimits

    encoded = []
    real_encode = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, *a: encoded.append(len(text)) or real_encode(
        self, text, *a))
    huge = SOURCE_LINE * (4_000_000 // len(SOURCE_LINE))
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content=huge)])

    async def body():
        async with fake_stack(fake_model, model_dir, limits=GatewayLimits(max_input_chars=10**8)) as (
                pairs, _, stub):
            started = time.monotonic()
            status = await status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(chat=chat)))
            return status, time.monotonic() - started, pairs[0].draft.seen.requests

    (code, details), refused_s, downstream = run(body())
    assert code == "INVALID_ARGUMENT" and details.startswith("the prompt has at least ")
    assert "the model's context holds 512" in details and not downstream
    assert max(encoded, default=0) < 1000 and refused_s < 3.0


def _live(kinds: tuple[type, ...], files: tuple[str, ...]) -> list:
    """Objects of `kinds`, and frames of code in `files`, that are still alive (the collector held off)."""
    return [o for o in gc.get_objects()
            if type(o) in kinds or type(o) is types.FrameType and o.f_code.co_filename.endswith(files)]


@pytest.mark.parametrize("case", ["refused after tokenizing", "refused downstream", "unauthenticated"])
def test_a_refused_calls_objects_are_freed_with_it(fake_model, model_dir, case):
    """A refused call's frames, and what they held (its request, its token ids), go when it ends, not at the
    garbage collector's next full pass: `context.abort` left its AbortError on the call's state, which the frames
    of its traceback reach (a cycle), and a gateway refusing 8 chats of 4 M characters 5 times grew from 0.1 to
    3.3 GB (QA). Now a refusal sets the call's status and the handler returns."""
    from gateway.fallback import FallbackGeneration, GenerationPlan
    from gateway.prompts import EncodedInput

    prompt = SOURCE_LINE * (300 if case == "refused after tokenizing" else 1)  # ~3000 tokens: past 512
    keys = (b"key",) if case == "unauthenticated" else ()
    metadata = (("authorization", "Bearer key"),) if keys else ()
    kinds = (EncodedInput, GenerationPlan, FallbackGeneration)
    files = ("gateway/servicer.py", "gateway/auth.py", "gateway/interceptors.py", "gateway/fallback.py",
             "specdec/rpc/errors.py")

    async def body():
        async with fake_stack(fake_model, model_dir, api_keys=keys) as (pairs, _, stub):
            if case == "refused downstream":
                pairs[0].draft.taken_prefixes = ("mine",)  # ALREADY_EXISTS for every id the stream may take
            await status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                prompt="def f():", sampling=common_pb2.SamplingParams(max_new_tokens=2)), metadata=metadata))
            gc.collect()
            gc.disable()
            try:
                status = await status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                    prompt=prompt, request_id="mine", sampling=common_pb2.SamplingParams(max_new_tokens=2))))
                await asyncio.sleep(0.1)
                return status, _live(kinds, files)
            finally:
                gc.enable()

    (code, _), left = run(body())
    assert code == {"refused after tokenizing": "INVALID_ARGUMENT", "refused downstream": "ALREADY_EXISTS",
                    "unauthenticated": "UNAUTHENTICATED"}[case]
    assert left == []


BIG_INPUTS = {
    "prompt": lambda text: gateway_pb2.GatewayServiceGenerateRequest(prompt=text),
    "chat": lambda text: gateway_pb2.GatewayServiceGenerateRequest(chat=gateway_pb2.ChatMessages(
        messages=[gateway_pb2.ChatMessage(role="user", content=text)])),
    "Tokenize": lambda text: gateway_pb2.TokenizeRequest(text=text),
}


@pytest.mark.parametrize("kind", BIG_INPUTS)
def test_a_large_input_is_tokenized_off_the_event_loop(fake_model, model_dir, monkeypatch, kind):
    """A text that may fit but is large is tokenized on a worker thread: with its tokenizing made to take 1.5 s,
    a small Generate and a health check sent meanwhile answer at once. Before, both waited behind it."""
    real_encode = Tokenizer.encode

    def slow_encode(self, text, *args):
        if len(text) >= OFF_LOOP_MIN_CHARS:
            time.sleep(1.5)
        return real_encode(self, text, *args)

    monkeypatch.setattr(Tokenizer, "encode", slow_encode)
    big = BIG_INPUTS[kind]((SOURCE_LINE * (OFF_LOOP_MIN_CHARS // len(SOURCE_LINE) + 1))[:OFF_LOOP_MIN_CHARS])

    async def body():
        async with fake_stack(fake_model, model_dir) as (_, gateway, stub):
            call = stub.Tokenize(big) if kind == "Tokenize" else stub.Generate(big)
            slow = asyncio.ensure_future(status_of(call))
            await asyncio.sleep(0.2)  # the big one is being tokenized
            started = time.monotonic()
            small = await status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                prompt="def fib(n):", sampling=common_pb2.SamplingParams(max_new_tokens=2))))
            small_s = time.monotonic() - started
            health_s = await health_check_s(gateway.port)
            return small, small_s, health_s, slow.done(), await slow

    small, small_s, health_s, slow_done_first, (slow_code, _) = run(body())
    assert small == ("OK", "") and small_s < 0.5 and health_s < 0.5
    assert not slow_done_first  # they answered while the big input was still being tokenized
    assert slow_code in ("OK", "INVALID_ARGUMENT")  # ~3700 tokens: more than the fakes' 512-token context


@pytest.mark.parametrize("request_id", ["line\nbreak [req=forged] INFO gateway.access ok", "x" * 10_000])
def test_the_access_log_shows_a_refused_request_id_escaped_and_cut(fake_model, model_dir, caplog, request_id):
    """A client's request id is bound to the access log before the servicer refuses it: a newline must not split
    the log line and 10 000 characters must not reach it."""
    caplog.handler.addFilter(ContextFilter())
    caplog.set_level(logging.INFO, logger="gateway.access")

    async def body():
        async with fake_stack(fake_model, model_dir) as (_, _, stub):
            return await status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                prompt="def fib(n):", request_id=request_id)))

    code, _ = run(body())
    (record,) = [r for r in caplog.records if r.name == "gateway.access"]
    line = logging.Formatter(TEXT_FORMAT).format(record)
    assert code == "INVALID_ARGUMENT"
    assert "\n" not in line and len(record.request_id) < 200 and len(line) < 400
    assert record.request_id.startswith(repr(request_id)[:20] if "\n" in request_id else "x" * 20)
    assert "\n" in request_id or record.request_id.endswith("...(10000 chars)")


def test_a_client_request_id_may_not_take_the_warm_up_prefix(fake_model, model_dir):
    """Ids starting `__warmup-` are left out of the target's metrics: a client's would hide its traffic."""
    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            refused = await status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                prompt="def fib(n):", request_id="__warmup-mine")))
            near = await status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                prompt="def fib(n):", request_id="warmup-mine", sampling=common_pb2.SamplingParams(max_new_tokens=2))))
            return refused, near, pairs[0].draft.seen.requests

    (code, details), near, downstream = run(body())
    assert code == "INVALID_ARGUMENT" and "'__warmup-'" in details and "reserved" in details
    assert near == ("OK", "") and [rid for rid, *_ in downstream] == ["warmup-mine"]


@pytest.mark.parametrize("no_speculation", [False, True])
def test_spec_values_are_checked_on_every_route(fake_model, model_dir, no_speculation):
    """`spec` below 1 is INVALID_ARGUMENT whether the request speculates or not (before, `no_speculation` skipped
    the check and the request ran); a valid `spec` runs either way."""
    def generate(stub, **spec):
        return stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
            prompt="def fib(n):", no_speculation=no_speculation, spec=common_pb2.SpecParams(**spec),
            sampling=common_pb2.SamplingParams(max_new_tokens=2)))

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            bad = [await status_of(generate(stub, **{field: value}))
                   for field, value in (("num_draft_tokens", -1), ("num_steps", 0), ("topk", 0))]
            good = await status_of(generate(stub, num_draft_tokens=2))
            return bad, good, pairs[0].draft.seen.requests + pairs[0].target.seen.requests

    bad, good, downstream = run(body())
    assert [code for code, _ in bad] == ["INVALID_ARGUMENT"] * 3
    assert "not {'num_draft_tokens': -1}" in bad[0][1] and "not {'topk': 0}" in bad[2][1]
    assert good == ("OK", "") and len(downstream) == 1  # only the good one went downstream


def test_a_spec_past_the_drafts_shape_is_refused_with_the_draft_down_too(fake_model, model_dir):
    """Upper bounds: the drafts' shape as the gateway learnt it. Before, `num_draft_tokens: 1000` was
    INVALID_ARGUMENT while the draft was up and ran (plainly, on the target) while it was down (QA)."""
    def generate(stub, **spec):
        return stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
            prompt="def fib(n):", spec=common_pb2.SpecParams(**spec),
            sampling=common_pb2.SamplingParams(max_new_tokens=2)))

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, gateway, stub):
            up = await status_of(generate(stub, num_draft_tokens=1000))
            await pairs[0].draft_handle.stop(None)
            gateway.router.report_failure(gateway.router.pairs[0], Part.DRAFT, "stopped")
            down = await status_of(generate(stub, num_draft_tokens=1000))
            fits = await status_of(generate(stub, num_draft_tokens=5))
            return up, down, fits, pairs[0].draft.seen.requests + pairs[0].target.seen.requests

    up, down, fits, downstream = run(body())
    assert up[0] == down[0] == "INVALID_ARGUMENT"
    assert "num_draft_tokens=5" in down[1] and "not {'num_draft_tokens': 1000}" in down[1]
    assert fits == ("OK", "") and len(downstream) == 1  # the fitting one ran, on the target


def test_pairs_of_different_shapes_each_take_the_specs_that_fit_them(fake_model, model_dir):
    """A chain pair (5, 1, 5) and a tree pair (4, 4, 12) behind one gateway: a spec that fits only the tree goes to
    the tree's draft whatever the load, one that fits neither whole (the chain's depth with the tree's topk) is
    INVALID_ARGUMENT at the gateway. Before, the answer depended on which pair a request was routed to (QA)."""
    def generate(stub, **spec):
        return stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
            prompt="def fib(n):", spec=common_pb2.SpecParams(**spec),
            sampling=common_pb2.SamplingParams(max_new_tokens=2)))

    async def body():
        async with fake_stack(fake_model, model_dir, num_pairs=2) as (pairs, gateway, stub):
            pairs[1].draft.shape = (4, 4, 12)
            await gateway.router.check_once()  # the gateway learns the drafts' shapes as health checks find them
            for pair in gateway.router.pairs:
                await gateway.router._learn_draft(pair)
            tree_only = [await status_of(generate(stub, topk=4)) for _ in range(4)]
            nodes = [await status_of(generate(stub, num_draft_tokens=12)) for _ in range(2)]
            neither = await status_of(generate(stub, num_steps=5, topk=4))
            return tree_only, nodes, neither, [len(p.draft.seen.requests) for p in pairs]

    tree_only, nodes, neither, seen = run(body())
    assert tree_only == [("OK", "")] * 4 and nodes == [("OK", "")] * 2
    assert seen == [0, 6]  # every one on the tree's draft
    assert neither[0] == "INVALID_ARGUMENT" and "no draft service runs a tree this spec fits" in neither[1]


def test_a_prompt_past_the_drafts_context_runs_plainly_on_the_target(fake_model, model_dir):
    """A draft started with a smaller --max-context than its target's: a prompt the target's context holds but the
    draft's does not is served plainly on the pair's target (the same text); shorter ones still go to the draft.
    Before, the draft refused it INVALID_ARGUMENT although the gateway's model card said it fit (QA)."""
    def generate(stub, prompt):
        return collect(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
            prompt=prompt, sampling=common_pb2.SamplingParams(max_new_tokens=3))))

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, gateway, stub):
            pairs[0].draft.max_context_len = 12
            await gateway.router._learn_draft(gateway.router.pairs[0])
            short = await generate(stub, "def f")
            long = await generate(stub, SOURCE_LINE * 3)
            return short, long, pairs[0].draft.seen.requests, pairs[0].target.seen.requests

    (_, _, short_stats, _), (long_text, _, long_stats, _), drafted, plain = run(body())
    assert short_stats.speculative and not long_stats.speculative and long_text
    assert len(drafted) == 1 and len(drafted[0][1]) < 12  # the short prompt, on the draft
    assert len(plain) == 1 and len(plain[0][1]) >= 12  # the long one, on the target


@pytest.mark.parametrize("size", [1001, 70_000])
@pytest.mark.parametrize("kind", BIG_INPUTS)
def test_an_input_over_max_input_chars_is_refused_before_tokenizing(fake_model, model_dir, monkeypatch, kind, size):
    """--max-input-chars bounds every input, chats and Tokenize texts included (no context bound holds for
    them: a template may leave text out, and Tokenize is not tied to the context): refused from its length,
    untokenized. Before, a 50 MB chat was tokenized (5-6 s of CPU) to be refused, and a 50 MB Tokenize held the
    event loop ~3 s building its 21M ids. A prompt past the context too (70k characters: at least 547 tokens)
    gets this message, the documented one, not the context's."""
    from gateway.config import GatewayLimits

    encoded = []
    real_encode = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, *a: encoded.append(len(text)) or real_encode(
        self, text, *a))
    limits = GatewayLimits(max_input_chars=1000)
    over, under = "x" * size, SOURCE_LINE * 3

    async def body():
        async with fake_stack(fake_model, model_dir, limits=limits) as (_, gateway, stub):
            call = stub.Tokenize if kind == "Tokenize" else stub.Generate
            refused = await status_of(call(BIG_INPUTS[kind](over)))
            served = await status_of(call(BIG_INPUTS[kind](under)))
            return refused, served

    (code, details), (ok, _) = run(body())
    assert code == "INVALID_ARGUMENT" and details == f"the input has {size} characters; the limit is 1000 " \
        "(--max-input-chars)"
    assert ok == "OK" and size not in encoded


def test_a_detokenize_of_many_ids_is_bounded_and_decoded_off_the_event_loop(fake_model, model_dir, tiny_tokenizer,
                                                                            monkeypatch):
    """Detokenize takes as many ids as Tokenize takes characters (--max-input-chars): 20 M ids held the gateway's
    event loop, and a running stream's tokens with it (5.4 s; QA). Under the limit, a large one is decoded on a
    worker thread, a small one on the loop, and the text is the tokenizer's."""
    import threading

    from gateway.config import GatewayLimits
    from gateway.prompts import OFF_LOOP_MIN_IDS

    threads = []
    real_decode, real_bytes = Tokenizer.decode, Tokenizer.decode_bytes
    monkeypatch.setattr(Tokenizer, "decode_bytes", lambda self, ids: threads.append(threading.current_thread().name)
                        or real_bytes(self, ids))
    limits = GatewayLimits(max_input_chars=4 * OFF_LOOP_MIN_IDS)
    ids = [t % 200 + 10 for t in range(3 * OFF_LOOP_MIN_IDS)]

    async def body():
        async with fake_stack(fake_model, model_dir, limits=limits) as (_, gateway, stub):
            loop_thread = threading.current_thread().name
            refused = await status_of(stub.Detokenize(gateway_pb2.DetokenizeRequest(
                token_ids=[10] * (limits.max_input_chars + 1))))
            # a message past what any valid request takes (`max_request_bytes`: 4 MiB at this limit) is refused by
            # gRPC before it is parsed: 20 M ids held the event loop, and every stream, 5.4 s (QA)
            too_big = await status_of(stub.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=[300] * 3_000_000)))
            threads.clear()
            served = await stub.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=ids))
            large = list(threads)
            short = await stub.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=ids[:5]))
            return (refused, too_big[0]), served.text, short.text, loop_thread, large, threads[len(large):]

    ((code, details), too_big), text, short, loop_thread, large, small = run(body())
    assert too_big == "RESOURCE_EXHAUSTED"
    assert code == "INVALID_ARGUMENT" and details == f"token_ids has {4 * OFF_LOOP_MIN_IDS + 1} ids; the limit is " \
        f"{4 * OFF_LOOP_MIN_IDS} (--max-input-chars)"
    assert text == real_decode(tiny_tokenizer, ids) and short == real_decode(tiny_tokenizer, ids[:5])
    # the large one off the loop, a part at a time (one call held the interpreter lock, and the loop, throughout);
    # the small one on it
    assert len(large) == 3 and loop_thread not in large and small == [loop_thread], (large, small)


def test_a_deadline_that_passes_is_logged_as_deadline_exceeded_not_as_a_cancel(fake_model, model_dir, caplog):
    """grpc cancels a handler whose deadline passed just as it does one whose client left; the access log (and
    the metrics and span status, which read the same) tell them apart. Before, both read CANCELLED."""
    caplog.set_level(logging.INFO, logger="gateway.access")

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            pairs[0].draft.hang_after_chunks = 1
            request = gateway_pb2.GatewayServiceGenerateRequest(
                prompt="def fib(n):", sampling=common_pb2.SamplingParams(max_new_tokens=100))
            late = await status_of(stub.Generate(request, timeout=0.5))
            call = stub.Generate(request)
            await call.read()
            call.cancel()
            await asyncio.sleep(0.3)
            return late

    late = run(body())
    assert late[0] == "DEADLINE_EXCEEDED"
    codes = [r.getMessage().split()[1] for r in caplog.records if r.name == "gateway.access"]
    assert codes == ["DEADLINE_EXCEEDED", "CANCELLED"], codes


def test_an_x_request_id_in_metadata_is_the_requests_id_and_is_checked(fake_model, model_dir):
    """A client that tags its call with `x-request-id` metadata (and no request_id in the body) gets that id on
    its stats and downstream, so its logs and ours line up; the id is checked like a body's."""
    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            request = gateway_pb2.GatewayServiceGenerateRequest(prompt="def fib(n):")
            _, _, final, _ = await collect(stub.Generate(request, metadata=(("x-request-id", "trace-me-7"),)))
            refused = await status_of(stub.Generate(request, metadata=(("x-request-id", "__warmup-x"),)))
            return final.request_id, pairs[0].draft.seen.requests, refused

    rid, downstream, (code, details) = run(body())
    assert rid == "trace-me-7" and downstream[0][0] == "trace-me-7"
    assert code == "INVALID_ARGUMENT" and "__warmup-" in details


def test_the_access_log_carries_the_request_id_the_gateway_generated(fake_model, model_dir, caplog):
    """A request without an id gets one from the gateway (in the final stats and downstream); its access-log line
    carries it too, so the gateway's logs join the draft's and the target's (QA: it was null)."""
    caplog.handler.addFilter(ContextFilter())
    caplog.set_level(logging.INFO, logger="gateway.access")

    async def body():
        async with fake_stack(fake_model, model_dir) as (_, _, stub):
            return await collect(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                prompt="def fib(n):", sampling=common_pb2.SamplingParams(max_new_tokens=4))))

    _, _, final, _ = run(body())
    (record,) = [r for r in caplog.records if r.name == "gateway.access"]
    assert len(final.request_id) == 32 and record.request_id == final.request_id


def test_a_cancelled_streams_access_line_carries_the_generated_request_id(fake_model, model_dir, caplog):
    """A stream the client cancels never gets its final stats; its line still names the id the gateway generated,
    the one the draft's and the target's lines carry (QA: `request_id: null`)."""
    caplog.handler.addFilter(ContextFilter())
    caplog.set_level(logging.INFO, logger="gateway.access")

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            call = await hanging_stream(pairs, stub)
            call.cancel()
            await asyncio.sleep(0.3)
            return pairs[0].draft.seen.requests

    downstream = run(body())
    (record,) = [r for r in caplog.records if r.name == "gateway.access"]
    assert record.grpc_status == "CANCELLED" and record.request_id == downstream[0][0]
    assert len(record.request_id) == 32


def test_the_access_log_says_why_a_request_was_refused(fake_model, model_dir, caplog):
    """A refused call's line carries its status message (`grpc_message`): with tracing off or sampled out it was
    only in the client's reply (QA)."""
    caplog.handler.addFilter(ContextFilter())
    caplog.set_level(logging.INFO, logger="gateway.access")

    async def body():
        async with fake_stack(fake_model, model_dir) as (_, _, stub):
            bad = await status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                prompt="def fib(n):", sampling=common_pb2.SamplingParams(temperature=-1.0))))
            good = await status_of(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(prompt="def fib(n):")))
            return bad, good

    (code, details), good = run(body())
    bad_line, good_line = [r for r in caplog.records if r.name == "gateway.access"]
    assert code == "INVALID_ARGUMENT" and bad_line.grpc_message == details
    assert "temperature must be in [0, 100]" in bad_line.getMessage()
    assert good == ("OK", "") and not hasattr(good_line, "grpc_message")
