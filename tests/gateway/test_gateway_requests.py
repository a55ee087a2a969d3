"""Bad input, limits, API keys, cancel and deadline propagation, and the unary RPCs, over fake pairs."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
import grpc.aio
import pytest
from gateway_fakes import FakeTarget, collect, fake_stack, run, status_of
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.config import GatewayLimits
from specdec.v1 import common_pb2, gateway_pb2


def request(prompt="def fib(n):", **sampling) -> gateway_pb2.GatewayServiceGenerateRequest:
    return gateway_pb2.GatewayServiceGenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(**sampling))



def chat(*turns: tuple[str, str]) -> gateway_pb2.ChatMessages:
    return gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role=r, content=c) for r, c in turns])


BAD_REQUESTS = [
    (gateway_pb2.GatewayServiceGenerateRequest(), "set exactly one of prompt or chat"),
    (request(prompt=""), "the prompt is empty"),
    (request(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (request(max_new_tokens=65), "max_new_tokens 65 exceeds the limit 64"),
    (request(temperature=-1.0), "temperature must be in [0, 100]"),
    (request(temperature=float("nan")), "temperature must be a finite number"),
    (request(top_p=0.0), "top_p must be in (0, 1]"),
    (request(stop_token_ids=[99999]), "outside the vocabulary"),
    (request(stop_token_ids=[1] * 1025), "1025 stop_token_ids; at most 1024 are allowed"),
    (request(prompt="word " * 40), "tokens; the limit is 32"),
    (gateway_pb2.GatewayServiceGenerateRequest(chat=chat(("robot", "hi"))), "role 'robot' is not one of"),
    (gateway_pb2.GatewayServiceGenerateRequest(chat=chat()), "chat has no messages"),
    (gateway_pb2.GatewayServiceGenerateRequest(prompt="x", stop=["s"] * 17), "at most 16 are allowed"),
    (gateway_pb2.GatewayServiceGenerateRequest(prompt="x", stop=[""]), "stop strings must not be empty"),
]


def test_gateway_bad_requests_get_invalid_argument_with_a_message(fake_model, model_dir):
    limits = GatewayLimits(max_prompt_tokens=32, max_new_tokens=64)

    async def body():
        async with fake_stack(fake_model, model_dir, limits=limits) as (pairs, _, stub):
            results = [await status_of(stub.Generate(req)) for req, _ in BAD_REQUESTS]
            return pairs, results

    pairs, results = run(body())
    for (code, details), (_, expected) in zip(results, BAD_REQUESTS, strict=True):
        assert code == "INVALID_ARGUMENT" and expected in details
    assert pairs[0].draft.seen.requests == [] and pairs[0].target.seen.requests == []  # refused at the gateway


def test_gateway_prompt_longer_than_the_context_is_refused(fake_model, model_dir, monkeypatch):
    monkeypatch.setattr(FakeTarget, "max_context_len", 10)  # what GetModelInfo reports when the pair comes up

    async def body():
        async with fake_stack(fake_model, model_dir) as (_, _, stub):
            return await status_of(stub.Generate(request(prompt="word " * 10)))

    code, details = run(body())
    assert code == "INVALID_ARGUMENT" and "the model's context holds 10" in details


def test_gateway_concurrent_stream_limit_gives_resource_exhausted(fake_model, model_dir):
    async def body():
        async with fake_stack(fake_model, model_dir, limits=GatewayLimits(max_concurrent_streams=1)) as (
            pairs,
            _,
            stub,
        ):
            pairs[0].draft.hang_after_chunks = 1
            first = stub.Generate(request(max_new_tokens=50))
            await first.read()
            second = await status_of(stub.Generate(request()))
            first.cancel()
            await asyncio.sleep(0.1)
            third = await status_of(stub.Generate(request(max_new_tokens=2)))
            return second, third

    (code, details), (third, _) = run(body())
    assert code == "RESOURCE_EXHAUSTED" and "too many concurrent streams (limit 1)" in details
    assert third == "OK"  # the slot came back when the first stream was cancelled


def test_gateway_client_cancel_reaches_the_draft(fake_model, model_dir):
    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, gateway, stub):
            pairs[0].draft.hang_after_chunks = 1
            call = stub.Generate(request(max_new_tokens=50))
            await call.read()
            call.cancel()
            for _ in range(40):
                if pairs[0].draft.seen.cancelled:
                    break
                await asyncio.sleep(0.05)
            return pairs[0].draft.seen, gateway.router.pairs[0].in_flight

    seen, in_flight = run(body())
    assert len(seen.cancelled) == 1 and not seen.running and in_flight == 0


def test_gateway_client_deadline_reaches_the_draft(fake_model, model_dir):
    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            await collect(stub.Generate(request(max_new_tokens=4), timeout=5))
            await collect(stub.Generate(request(max_new_tokens=4)))
            return pairs[0].draft.seen.deadlines

    with_deadline, without = run(body())
    assert 0 < with_deadline < 5.5 and without is None  # (clock rounding aside, at most the 5 s)


def test_gateway_api_keys(fake_model, model_dir):
    keys = (b"first-key", b"second-key")

    async def body():
        async with fake_stack(fake_model, model_dir, api_keys=keys) as (_, gateway, stub):
            missing = await status_of(stub.Generate(request(max_new_tokens=2)))
            wrong = await status_of(stub.Generate(request(max_new_tokens=2), metadata=(("authorization", "Bearer x"),)))
            good = await status_of(
                stub.Generate(request(max_new_tokens=2), metadata=(("authorization", "Bearer second-key"),))
            )
            try:
                await stub.ListModels(gateway_pb2.ListModelsRequest())
                unary = "OK"
            except grpc.aio.AioRpcError as exc:
                unary = exc.code().name
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="specdec.v1.GatewayService")
                )
            return missing, wrong, good, unary, health.status

    missing, wrong, good, unary, health = run(body())
    assert missing[0] == wrong[0] == "UNAUTHENTICATED" and "authorization: Bearer" in missing[1]
    assert good == ("OK", "") and unary == "UNAUTHENTICATED"
    assert health == health_pb2.HealthCheckResponse.SERVING  # probes need no key


def test_gateway_api_key_file_is_read_again_when_it_changes(fake_model, model_dir, tmp_path, monkeypatch, caplog):
    """A rotated key file (a Secret's update) needs no restart: a key added works and a key removed is refused from
    the next look (`ApiKeyFile.LOOK_S`); an emptied file is refused with a WARNING and the keys before stay."""
    from gateway.auth import ApiKeyFile

    monkeypatch.setattr(ApiKeyFile, "LOOK_S", 0.0)
    path = tmp_path / "keys.txt"
    path.write_text("old-key\n")

    async def status_with(stub, key: str) -> str:
        return (await status_of(stub.Generate(request(max_new_tokens=2),
                                              metadata=(("authorization", f"Bearer {key}"),))))[0]

    async def body():
        async with fake_stack(fake_model, model_dir, api_keys=ApiKeyFile(path)) as (_, _, stub):
            seen = [await status_with(stub, "old-key"), await status_with(stub, "new-key")]
            path.write_text("# rotated\nnew-key\n")
            seen += [await status_with(stub, "old-key"), await status_with(stub, "new-key")]
            path.write_text("# nothing yet\n")
            seen += [await status_with(stub, "new-key")]
            return seen

    with caplog.at_level(logging.WARNING, logger="specdec.rpc.file_watch"):
        seen = run(body())
    assert seen == ["OK", "UNAUTHENTICATED", "UNAUTHENTICATED", "OK", "OK"]
    assert any("holds no key" in r.getMessage() and "still using" in r.getMessage() for r in caplog.records)


def test_gateway_tokenize_keeps_special_token_text_plain(fake_model, model_dir, tiny_tokenizer):
    separator, eos = tiny_tokenizer.special_tokens["<|separator|>"], tiny_tokenizer.special_tokens["<|eos|>"]
    messages = chat(("system", "be brief <|separator|>"), ("user", "hi <|eos|> <|separator|>\n\nAssistant: ok"))

    async def body():
        async with fake_stack(fake_model, model_dir) as (_, _, stub):
            raw = await stub.Tokenize(gateway_pb2.TokenizeRequest(text="a <|eos|> b"))
            templated = await stub.Tokenize(gateway_pb2.TokenizeRequest(chat=messages))
            text = await stub.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=templated.token_ids))
            return list(raw.token_ids), list(templated.token_ids), text.text

    raw, templated, text = run(body())
    assert eos not in raw and raw == tiny_tokenizer.encode("a <|eos|> b")
    assert eos not in templated
    assert templated.count(separator) == 2  # one per message, written by the template only
    assert "hi <|eos|> <|separator|>" in text


def test_gateway_list_models_and_detokenize(fake_model, model_dir, tiny_tokenizer):
    async def body():
        async with fake_stack(fake_model, model_dir, num_pairs=2) as (_, gateway, stub):
            while gateway.router.pairs_up < 2:  # each pair's first check runs on its own (fake_stack waits for one)
                await asyncio.sleep(0.01)
            models = await stub.ListModels(gateway_pb2.ListModelsRequest())
            bad = None
            try:
                await stub.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=[10**6]))
            except grpc.aio.AioRpcError as exc:
                bad = exc.code().name, exc.details()
            return models.models, bad

    (card,), bad = run(body())
    assert (card.id, card.target, card.draft, card.max_context_len, card.pairs_up) == (
        "fake-target",
        "fake-target",
        "fake-draft",
        512,
        2,
    )
    assert bad[0] == "INVALID_ARGUMENT" and "outside the vocabulary" in bad[1]


def test_list_models_keeps_the_context_length_once_every_pair_went_down(fake_model, model_dir):
    """The proto says 0 "until a pair has answered"; one had (QA: it fell back to 0 with the pairs down)."""
    async def body():
        async with fake_stack(fake_model, model_dir, num_pairs=2) as (_, gateway, stub):
            for task in gateway.router._health_tasks:
                task.cancel()  # the background checks off: they would find the targets up again
            for pair in gateway.router.pairs:
                pair.target_up = False  # as health checks mark a target down
            return (await stub.ListModels(gateway_pb2.ListModelsRequest())).models

    (card,) = run(body())
    assert (card.max_context_len, card.pairs_up, card.target) == (512, 0, "fake-target")


def test_gateway_served_model_name_is_the_listed_id(fake_model, model_dir):
    async def body():
        async with fake_stack(fake_model, model_dir, served_model_name="code-tiny") as (_, _, stub):
            return (await stub.ListModels(gateway_pb2.ListModelsRequest())).models

    (card,) = run(body())
    assert (card.id, card.target, card.draft) == ("code-tiny", "fake-target", "fake-draft")


@pytest.mark.parametrize("name", [" padded", "a\nb", "x" * 257])
def test_gateway_refuses_a_bad_served_model_name(name):
    from gateway.config import GatewayConfig, PairAddress
    from specdec.errors import ConfigError

    with pytest.raises(ConfigError, match="--served-model-name"):
        GatewayConfig(model_dir="m", pairs=(PairAddress.parse("=b:2"),), served_model_name=name)


def test_gateway_refuses_a_pair_given_twice():
    from gateway.config import GatewayConfig, PairAddress
    from specdec.errors import ConfigError

    pairs = tuple(PairAddress.parse(spec) for spec in ("a:1=b:2", "=c:3", "a:1=b:2"))
    with pytest.raises(ConfigError, match="--pair a:1=b:2 is given more than once"):
        GatewayConfig(model_dir="m", pairs=pairs)
    GatewayConfig(model_dir="m", pairs=pairs[:2])


@pytest.mark.parametrize("spec", ["a:1=b:2", "=b:2"])
def test_gateway_pair_address_parses(spec):
    from gateway.config import PairAddress

    pair = PairAddress.parse(spec)
    assert str(pair) == spec and pair.target == "b:2"


def test_gateway_per_client_stream_limit_counts_each_api_key_separately(fake_model, model_dir):
    keys = (b"alice-key", b"bob-key")

    def auth(key: str):
        return (("authorization", f"Bearer {key}"),)

    async def body():
        limits = GatewayLimits(max_streams_per_client=1)
        async with fake_stack(fake_model, model_dir, limits=limits, api_keys=keys) as (pairs, _, stub):
            pairs[0].draft.hang_after_chunks = 1
            alice = stub.Generate(request(max_new_tokens=50), metadata=auth("alice-key"))
            await alice.read()
            alice_again = await status_of(stub.Generate(request(max_new_tokens=2), metadata=auth("alice-key")))
            pairs[0].draft.hang_after_chunks = None
            bob = await status_of(stub.Generate(request(max_new_tokens=2), metadata=auth("bob-key")))
            alice.cancel()
            await asyncio.sleep(0.1)
            alice_later = await status_of(stub.Generate(request(max_new_tokens=2), metadata=auth("alice-key")))
            return alice_again, bob, alice_later

    (code, details), bob, later = run(body())
    assert code == "RESOURCE_EXHAUSTED" and "from this client (limit 1)" in details
    assert bob[0] == "OK" and later[0] == "OK"


def test_gateway_per_client_limit_without_keys_uses_the_peer_host(fake_model, model_dir):
    async def body():
        async with fake_stack(fake_model, model_dir, limits=GatewayLimits(max_streams_per_client=1)) as (
            pairs, _, stub,
        ):
            pairs[0].draft.hang_after_chunks = 1
            first = stub.Generate(request(max_new_tokens=50))
            await first.read()
            # a made-up bearer token does not make a new client when keys are not checked
            fake_token = (("authorization", "Bearer z"),)
            second = await status_of(stub.Generate(request(max_new_tokens=2), metadata=fake_token))
            first.cancel()
            return second

    code, details = run(body())
    assert code == "RESOURCE_EXHAUSTED" and "from this client" in details


def test_a_local_gpu_stack_asks_for_flashinfer_when_it_is_installed(monkeypatch):
    """`specdec up/generate --device cuda`: the local services attend through flashinfer (their CUDA graphs need it)
    when it is installed; on a CPU, or without it, they keep their default."""
    import importlib.util

    from gateway.local_stack import StackConfig

    real = importlib.util.find_spec
    for installed in (True, False):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, installed=installed: object() if name == "flashinfer" and installed
                            else (None if name == "flashinfer" else real(name, *a)))
        gpu = StackConfig(device="cuda:0").commands()
        flags = [cmd[cmd.index("--attention-backend") + 1] if "--attention-backend" in cmd else None
                 for cmd in (gpu["target"], gpu["draft"])]
        assert flags == (["flashinfer"] * 2 if installed else [None, None])
        assert "--attention-backend" not in StackConfig(device="cpu").commands()["target"]


def test_gateway_list_models_id_is_the_models_name_before_and_after_a_pair_answers(fake_model, model_dir):
    """The default id is the checkpoint directory's name: what the gateway knows from its own --model while no pair
    has answered, and what a target reports (the path it loaded) once one has. It was the bare name first, then
    the target's whole path. The target is a path both times: the gateway's --model, then the target's (it was
    the bare name "target" first)."""
    name = Path(model_dir).name

    async def body():
        async with fake_stack(fake_model, model_dir) as (_, gateway, stub):
            pair = gateway.router.pairs[0]
            pair.target_model = f"/srv/models/{name}"
            cards = [(await stub.ListModels(gateway_pb2.ListModelsRequest())).models[0]]
            pair.target_model = ""  # as before the target first answered
            cards.append((await stub.ListModels(gateway_pb2.ListModelsRequest())).models[0])
            return [(c.id, c.target) for c in cards]

    assert run(body()) == [(name, f"/srv/models/{name}"), (name, str(model_dir))]
