"""Fuzz every service with thousands of random and malformed messages (hypothesis), then check the services are
healthy, every KV page is back, and a greedy request gives the same tokens as before the fuzzing.

Each call must end OK or with a status that names the caller's mistake (INVALID_ARGUMENT, NOT_FOUND,
ALREADY_EXISTS, RESOURCE_EXHAUSTED); undecodable bytes get INVALID_ARGUMENT "malformed request: ..."
(`specdec/rpc/decode_guard.py`; before it, grpcio's own UNKNOWN with a logged traceback).
Never a crash, a hang, an UNKNOWN or an INTERNAL. Counts land in `COUNTS` (docs/reliability.md).
"""

from __future__ import annotations

import collections

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_support import (
    DRAFT_HEALTH,
    GATEWAY_HEALTH,
    PROMPT_IDS,
    SERVING,
    TARGET_HEALTH,
    draft_kv,
    health,
    start_draft,
    start_gateway,
    start_target,
    target_kv,
    wait_whole,
)

from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, gateway_pb2, gateway_pb2_grpc, target_pb2, target_pb2_grpc

EXAMPLES = 300  # per fuzz test below; 8 tests, about 3,900 calls
ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
           grpc.StatusCode.RESOURCE_EXHAUSTED}
COUNTS: collections.Counter = collections.Counter()
MALFORMED: collections.Counter = collections.Counter()  # raw byte strings refused as not a message
PREFILLED: set[str] = {"live-0", "live-1"}
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

ids = st.one_of(st.sampled_from(["", "a", "b", "live-0", "live-1", "x" * 300]), st.text(max_size=12))
token = st.one_of(st.integers(0, 8191), st.integers(-(2**31), 2**31 - 1))
prompts = st.lists(token, max_size=24)
maybe = lambda s: st.one_of(st.none(), s)  # noqa: E731
sampling = st.builds(
    lambda t, k, p, m, seed, n, stops, ign: common_pb2.SamplingParams(
        **{k_: v for k_, v in dict(temperature=t, top_k=k, top_p=p, min_p=m, seed=seed, max_new_tokens=n,
                                   ignore_eos=ign).items() if v is not None}, stop_token_ids=stops),
    maybe(st.floats(allow_nan=True, allow_infinity=True, width=64) | st.floats(0, 2)),
    maybe(st.integers(-(2**31), 2**31 - 1) | st.integers(0, 50)),
    maybe(st.floats(allow_nan=True, width=64) | st.floats(0, 1)),
    maybe(st.floats(allow_nan=True, width=64) | st.floats(0, 1)),
    maybe(st.integers(0, 2**64 - 1)),
    maybe(st.integers(-3, 6)),
    st.lists(token, max_size=3),
    maybe(st.booleans()),
)
trees = st.builds(
    lambda rid, toks, pars: target_pb2.TreeProposal(request_id=rid, draft_tokens=toks, parents=pars),
    ids, st.lists(token, max_size=70), st.lists(st.integers(-3, 70) | st.integers(-(2**31), 2**31 - 1), max_size=70),
)


@pytest.fixture(scope="module")
def stack():
    target = start_target("--max-queue-wait-seconds", "0.2")
    draft = start_draft(target.addr, "--max-queue-wait-seconds", "0.2")
    gateway = start_gateway(f"{draft.addr}={target.addr}")
    channels = {name: grpc.insecure_channel(s.addr) for name, s in (("t", target), ("d", draft), ("g", gateway))}
    stubs = {"t": target_pb2_grpc.TargetServiceStub(channels["t"]), "d": draft_pb2_grpc.DraftServiceStub(channels["d"]),
             "g": gateway_pb2_grpc.GatewayServiceStub(channels["g"])}
    yield {"target": target, "draft": draft, "gateway": gateway, "stubs": stubs, "channels": channels,
           "greedy_before": _greedy(stubs["d"])}
    for ch in channels.values():
        ch.close()
    for s in (gateway, draft, target):
        s.stop()


def _greedy(stub) -> list[int]:
    req = draft_pb2.DraftServiceGenerateRequest(request_id="probe", prompt_ids=PROMPT_IDS,
                                                sampling=common_pb2.SamplingParams(max_new_tokens=40, ignore_eos=True))
    return [t for m in stub.Generate(req, timeout=60) for t in m.token_ids]


def _send(kind: str, call, raw: bool = False) -> None:
    COUNTS[kind] += 1
    try:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            list(result)
    except grpc.RpcError as exc:
        code = exc.code()
        assert code in ALLOWED, f"{kind}: {code} {exc.details()}"
        assert exc.details(), f"{kind}: {code} without a message"
        if raw and code == grpc.StatusCode.INVALID_ARGUMENT:
            MALFORMED[kind] += "malformed request" in exc.details()


@FUZZ
@given(rid=ids, prompt=prompts, s=maybe(sampling), layers=st.lists(st.integers(-5, 12), max_size=4),
       features=st.booleans())
def test_reliability_fuzz_target_prefill(stack, rid, prompt, s, layers, features):
    req = target_pb2.PrefillRequest(request_id=rid, prompt_ids=prompt, sampling=s, feature_layer_ids=layers,
                                    return_features=features)
    PREFILLED.add(rid)  # a prefilled request stays resident until Release (by design); released at the end
    _send("target Prefill", lambda: stack["stubs"]["t"].Prefill(req, timeout=30))


@FUZZ
@given(batch=st.lists(trees, max_size=4), release=st.lists(ids, max_size=3))
def test_reliability_fuzz_target_verify_release(stack, batch, release):
    stub = stack["stubs"]["t"]
    for rid in ("live-0", "live-1"):  # keep two resident requests for the trees to hit
        _send("target Prefill", lambda rid=rid: stub.Prefill(target_pb2.PrefillRequest(
            request_id=rid, prompt_ids=PROMPT_IDS, sampling=common_pb2.SamplingParams(max_new_tokens=1000)),
            timeout=30))
    _send("target Verify", lambda: stub.Verify(target_pb2.VerifyRequest(trees=batch), timeout=30))
    _send("target Release", lambda: stub.Release(target_pb2.ReleaseRequest(request_ids=release), timeout=30))


@FUZZ
@given(rid=ids, prompt=prompts, s=maybe(sampling))
def test_reliability_fuzz_target_generate(stack, rid, prompt, s):
    req = target_pb2.TargetServiceGenerateRequest(request_id=rid, prompt_ids=prompt, sampling=s)
    _send("target Generate", lambda: stack["stubs"]["t"].Generate(req, timeout=30))


@FUZZ
@given(rid=ids, prompt=prompts, s=maybe(sampling),
       spec=maybe(st.builds(common_pb2.SpecParams, num_steps=st.integers(0, 9), topk=st.integers(0, 3),
                            num_draft_tokens=st.integers(0, 70))), abort=ids)
def test_reliability_fuzz_draft(stack, rid, prompt, s, spec, abort):
    stub = stack["stubs"]["d"]
    req = draft_pb2.DraftServiceGenerateRequest(request_id=rid, prompt_ids=prompt, sampling=s, spec=spec)
    _send("draft Generate", lambda: stub.Generate(req, timeout=30))
    _send("draft Abort", lambda: stub.Abort(draft_pb2.AbortRequest(request_id=abort), timeout=30))


roles = st.sampled_from(["system", "user", "assistant", "", "root", "USER"])
chats = st.lists(st.builds(gateway_pb2.ChatMessage, role=roles, content=st.text(max_size=40)), max_size=4)


@FUZZ
@given(prompt=maybe(st.text(max_size=80)), chat=maybe(chats), s=maybe(sampling),
       stop=st.lists(st.text(max_size=300), max_size=18), no_spec=st.booleans(), rid=st.text(max_size=40))
def test_reliability_fuzz_gateway_generate(stack, prompt, chat, s, stop, no_spec, rid):
    req = gateway_pb2.GatewayServiceGenerateRequest(sampling=s, stop=stop, no_speculation=no_spec, request_id=rid)
    if prompt is not None:
        req.prompt = prompt
    if chat is not None:
        req.chat.CopyFrom(gateway_pb2.ChatMessages(messages=chat))
    _send("gateway Generate", lambda: stack["stubs"]["g"].Generate(req, timeout=30))


@FUZZ
@given(text=maybe(st.text(max_size=200)), chat=maybe(chats), ids_=st.lists(token, max_size=30))
def test_reliability_fuzz_gateway_tokenize_detokenize(stack, text, chat, ids_):
    stub = stack["stubs"]["g"]
    req = gateway_pb2.TokenizeRequest()
    if text is not None:
        req.text = text
    if chat is not None:
        req.chat.CopyFrom(gateway_pb2.ChatMessages(messages=chat))
    _send("gateway Tokenize", lambda: stub.Tokenize(req, timeout=30))
    _send("gateway Detokenize", lambda: stub.Detokenize(gateway_pb2.DetokenizeRequest(token_ids=ids_), timeout=30))


METHODS = {
    "t": ["/specdec.v1.TargetService/Prefill", "/specdec.v1.TargetService/Verify",
          "/specdec.v1.TargetService/Release", "/specdec.v1.TargetService/GetModelInfo"],
    "d": ["/specdec.v1.DraftService/Abort", "/specdec.v1.DraftService/GetModelInfo"],
    "g": ["/specdec.v1.GatewayService/Tokenize", "/specdec.v1.GatewayService/Detokenize",
          "/specdec.v1.GatewayService/ListModels"],
}
STREAMS = {"t": "/specdec.v1.TargetService/Generate", "d": "/specdec.v1.DraftService/Generate",
           "g": "/specdec.v1.GatewayService/Generate"}


@FUZZ
@given(service=st.sampled_from(["t", "d", "g"]), which=st.integers(0, 3), data=st.binary(max_size=200))
def test_reliability_fuzz_raw_bytes_unary(stack, service, which, data):
    method = METHODS[service][which % len(METHODS[service])]
    call = stack["channels"][service].unary_unary(method)
    _send("raw bytes", lambda: call(data, timeout=30), raw=True)


@FUZZ
@given(service=st.sampled_from(["t", "d", "g"]), data=st.binary(max_size=200))
def test_reliability_fuzz_raw_bytes_streams(stack, service, data):
    call = stack["channels"][service].unary_stream(STREAMS[service])
    _send("raw bytes", lambda: call(data, timeout=30), raw=True)


def test_reliability_fuzz_services_whole_afterwards(stack):
    stubs = stack["stubs"]
    resident = sorted(r for r in PREFILLED if 0 < len(r) <= 256)
    released = stubs["t"].Release(target_pb2.ReleaseRequest(request_ids=resident), timeout=30)
    for addr, name in ((stack["target"].addr, TARGET_HEALTH), (stack["draft"].addr, DRAFT_HEALTH),
                       (stack["gateway"].addr, GATEWAY_HEALTH)):
        assert health(addr, name) == SERVING
    free, total, running = wait_whole(target_kv, stack["target"].addr)
    assert (free, running) == (total, 0), "target KV leaked"
    free, total, running = wait_whole(draft_kv, stack["draft"].addr)
    assert (free, running) == (total, 0), "draft KV leaked"
    assert _greedy(stubs["d"]) == stack["greedy_before"]
    print("fuzz calls:", dict(COUNTS), "total", sum(COUNTS.values()), "released", released.num_released,
          "malformed:", dict(MALFORMED))
