"""Every RPC of every service refuses bad input with the right status and a message, while a good request runs
alongside unaffected; afterwards the services are healthy and every KV page is back.

The cases are tables (`TARGET_CASES`, `DRAFT_CASES`, `GATEWAY_CASES`); docs/reliability.md counts them by kind.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import grpc
import pytest
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

from specdec.errors import InvalidInput
from specdec.rpc.tensor_codec import tensor_from_proto
from specdec.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    target_pb2,
    target_pb2_grpc,
)

INVALID, NOT_FOUND, EXISTS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                              grpc.StatusCode.ALREADY_EXISTS)
S = common_pb2.SamplingParams

# (kind, sampling, message fragment): the same ranges are checked by every service that takes sampling params
SAMPLING_CASES = [
    ("max_new_tokens", S(max_new_tokens=0), "max_new_tokens must be >= 1"),
    ("max_new_tokens", S(max_new_tokens=-5), "max_new_tokens must be >= 1"),
    ("temperature", S(temperature=-1.0), "temperature must be in [0, 100]"),
    ("temperature", S(temperature=1e9), "temperature must be in [0, 100]"),
    ("temperature", S(temperature=math.nan), "temperature must be a finite number"),
    ("temperature", S(temperature=math.inf), "temperature must be a finite number"),
    ("top_k", S(top_k=-1), "top_k must be in"),
    ("top_p", S(top_p=0.0), "top_p must be in (0, 1]"),
    ("top_p", S(top_p=1.5), "top_p must be in (0, 1]"),
    ("top_p", S(top_p=math.nan), "top_p must be a finite number"),
    ("min_p", S(min_p=1.0), "min_p must be in [0, 1)"),
    ("min_p", S(min_p=-0.1), "min_p must be in [0, 1)"),
    ("seed", S(seed=(1 << 63) + 5), "seed must be in [0, 2^63-1]"),
    ("stop_token_ids", S(stop_token_ids=[8192]), "outside the vocabulary"),
    ("stop_token_ids", S(stop_token_ids=[2] * 1025), "at most 1024 are allowed"),
]
# (kind, prompt ids, message fragment)
PROMPT_CASES = [
    ("empty prompt", [], "prompt is empty"),
    ("token id over the vocab", [1, 8192], "outside the vocabulary [0, 8192)"),
    ("negative token id", [1, -3], "outside the vocabulary"),
    ("prompt over the context", [5] * 2048, "context length is 2048"),
]
TREE = target_pb2.TreeProposal


def _target_cases() -> list[tuple]:
    """(kind, method, request, code, fragment); 'live' is a request id prefilled on the target first."""
    P, R = target_pb2.PrefillRequest, target_pb2.VerifyRequest
    G = target_pb2.TargetServiceGenerateRequest
    cases = []
    for kind, prompt, frag in PROMPT_CASES:
        cases.append((kind, "Prefill", P(request_id="p", prompt_ids=prompt), INVALID, frag))
        cases.append((kind, "Generate", G(request_id="g", prompt_ids=prompt), INVALID, frag))
    for kind, sampling, frag in SAMPLING_CASES:
        cases.append((kind, "Prefill", P(request_id="p", prompt_ids=PROMPT_IDS, sampling=sampling), INVALID, frag))
        cases.append((kind, "Generate", G(request_id="g", prompt_ids=PROMPT_IDS, sampling=sampling), INVALID, frag))
    cases += [
        ("empty request id", "Prefill", P(prompt_ids=PROMPT_IDS), INVALID, "request_id is empty"),
        ("over-long request id", "Prefill", P(request_id="x" * 300, prompt_ids=PROMPT_IDS), INVALID,
         "request_id longer than 256"),
        ("empty request id", "Generate", G(prompt_ids=PROMPT_IDS), INVALID, "request_id is empty"),
        ("feature layer out of range", "Prefill", P(request_id="p", prompt_ids=PROMPT_IDS, feature_layer_ids=[99]),
         INVALID, "feature layer 99 outside [0, 8]"),
        ("too many feature layers", "Prefill", P(request_id="p", prompt_ids=PROMPT_IDS, feature_layer_ids=[1] * 9),
         INVALID, "9 feature layers asked for; at most 8"),
        ("negative num_generated", "Verify", R(trees=[TREE(request_id="live", num_generated=-5)]), INVALID,
         "is negative"),
        ("num_generated past reach", "Verify", R(trees=[TREE(request_id="live", num_generated=10**6)]), INVALID,
         "past anything it can reach"),
        ("duplicate request id", "Prefill", P(request_id="live", prompt_ids=PROMPT_IDS), EXISTS, "already running"),
        ("unknown request id", "Verify", R(trees=[TREE(request_id="ghost")]), NOT_FOUND, "unknown request id"),
        ("empty request id", "Verify", R(trees=[TREE()]), INVALID, "request_id is empty"),
        ("duplicate request id", "Verify", R(trees=[TREE(request_id="live"), TREE(request_id="live")]), INVALID,
         "appears twice"),
        ("tree parent out of range", "Verify", R(trees=[TREE(request_id="live", draft_tokens=[5], parents=[7])]),
         INVALID, "parent 7 of draft node 0"),
        ("tree parent below -1", "Verify", R(trees=[TREE(request_id="live", draft_tokens=[5], parents=[-2])]),
         INVALID, "parent -2"),
        ("tree parent after child", "Verify",
         R(trees=[TREE(request_id="live", draft_tokens=[5, 6], parents=[1, -1])]), INVALID, "earlier node index"),
        ("tree parent is itself", "Verify",
         R(trees=[TREE(request_id="live", draft_tokens=[5, 6], parents=[-1, 1])]), INVALID, "earlier node index"),
        ("tree tokens/parents lengths differ", "Verify",
         R(trees=[TREE(request_id="live", draft_tokens=[5, 6], parents=[-1])]), INVALID, "2 tokens but 1 parents"),
        ("tree over the maximum size", "Verify",
         R(trees=[TREE(request_id="live", draft_tokens=[5] * 65, parents=list(range(-1, 64)))]), INVALID,
         "more than the maximum 64"),
        ("tree token over the vocab", "Verify",
         R(trees=[TREE(request_id="live", draft_tokens=[9000], parents=[-1])]), INVALID, "draft token 9000"),
        ("tree mixing a good and a bad request", "Verify",
         R(trees=[TREE(request_id="live", draft_tokens=[5], parents=[-1]), TREE(request_id="ghost")]), NOT_FOUND,
         "unknown request id"),
        ("empty request id", "Release", target_pb2.ReleaseRequest(request_ids=[""]), INVALID, "request_id is empty"),
    ]
    return cases


def _draft_cases() -> list[tuple]:
    D = draft_pb2.DraftServiceGenerateRequest
    cases = [(kind, "Generate", D(request_id="d", prompt_ids=p), INVALID, f) for kind, p, f in PROMPT_CASES]
    cases += [(kind, "Generate", D(request_id="d", prompt_ids=PROMPT_IDS, sampling=s), INVALID, f)
              for kind, s, f in SAMPLING_CASES]
    cases += [
        ("empty request id", "Generate", D(prompt_ids=PROMPT_IDS), INVALID, "request_id is empty"),
        ("over-long request id", "Generate", D(request_id="y" * 257, prompt_ids=PROMPT_IDS), INVALID,
         "longer than 256"),
        ("tree larger than the service's", "Generate",
         D(request_id="d", prompt_ids=PROMPT_IDS, spec=common_pb2.SpecParams(num_draft_tokens=999)), INVALID,
         "from 1 up to that, not {'num_draft_tokens': 999}"),
        ("tree of no steps", "Generate",
         D(request_id="d", prompt_ids=PROMPT_IDS, spec=common_pb2.SpecParams(num_steps=0)), INVALID,
         "not {'num_steps': 0}"),
        ("empty request id", "Abort", draft_pb2.AbortRequest(), INVALID, "request_id is empty"),
    ]
    return cases


def _gateway_cases() -> list[tuple]:
    G = gateway_pb2.GatewayServiceGenerateRequest
    chat = gateway_pb2.ChatMessages
    msg = gateway_pb2.ChatMessage
    cases = [(kind, "Generate", G(prompt="def f():", sampling=s), INVALID, f)
             for kind, s, f in SAMPLING_CASES]
    cases += [
        ("neither prompt nor chat", "Generate", G(), INVALID, "exactly one of prompt or chat"),
        ("empty prompt", "Generate", G(prompt=""), INVALID, ""),
        ("bad chat role", "Generate", G(chat=chat(messages=[msg(role="wizard", content="hi")])), INVALID, "role"),
        ("prompt over --max-prompt-tokens", "Generate", G(prompt="word " * 200), INVALID, "the limit is 64"),
        ("max_new_tokens over the limit", "Generate", G(prompt="x", sampling=S(max_new_tokens=5000)), INVALID,
         "exceeds the limit 4096"),
        ("too many stop strings", "Generate", G(prompt="x", stop=["a"] * 17), INVALID, "at most 16"),
        ("empty stop string", "Generate", G(prompt="x", stop=[""]), INVALID, "must not be empty"),
        ("over-long stop string", "Generate", G(prompt="x", stop=["s" * 257]), INVALID, "the limit is 256"),
        ("request id not printable ASCII", "Generate", G(prompt="x", request_id="r\u00e9\n"), INVALID,
         "printable ASCII"),
        ("over-long request id", "Generate", G(prompt="x", request_id="r" * 129), INVALID, "the limit is 128"),
        ("token id over the vocab", "Detokenize", gateway_pb2.DetokenizeRequest(token_ids=[8192]), INVALID, ""),
        ("negative token id", "Detokenize", gateway_pb2.DetokenizeRequest(token_ids=[-1]), INVALID, ""),
        ("neither text nor chat", "Tokenize", gateway_pb2.TokenizeRequest(), INVALID, ""),
    ]
    return cases


TARGET_CASES, DRAFT_CASES, GATEWAY_CASES = _target_cases(), _draft_cases(), _gateway_cases()


@pytest.fixture(scope="module")
def stack():
    target = start_target()
    draft = start_draft(target.addr)
    gateway = start_gateway(f"{draft.addr}={target.addr}", extra=("--max-prompt-tokens", "64"))
    yield target, draft, gateway
    for s in (gateway, draft, target):
        s.stop()


def _call(stub, method: str, request):
    result = getattr(stub, method)(request, timeout=30)
    return list(result) if method == "Generate" else result


def _expect(stub, case) -> None:
    kind, method, request, code, fragment = case
    with pytest.raises(grpc.RpcError) as err:
        _call(stub, method, request)
    assert err.value.code() == code, f"{kind} ({method}): {err.value.code()} {err.value.details()}"
    assert err.value.details() and fragment in err.value.details(), f"{kind}: {err.value.details()}"


class _Background:
    """A good long request running through the draft while the bad ones arrive; its tokens must not change."""

    def __init__(self, draft_addr: str):
        self.channel = grpc.insecure_channel(draft_addr)
        stub = draft_pb2_grpc.DraftServiceStub(self.channel)
        req = draft_pb2.DraftServiceGenerateRequest(request_id="good", prompt_ids=PROMPT_IDS,
                                                    sampling=S(max_new_tokens=300, ignore_eos=True))
        self.call = stub.Generate(req, timeout=120)
        self.tokens: list[int] = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read)
        self.thread.start()

    def _read(self) -> None:
        try:
            self.tokens.extend(t for m in self.call for t in m.token_ids)
        except grpc.RpcError as exc:
            self.error = exc

    def result(self) -> list[int]:
        self.thread.join(120)
        self.channel.close()
        assert self.error is None, self.error
        return self.tokens


def _reference(draft_addr: str) -> list[int]:
    with grpc.insecure_channel(draft_addr) as ch:
        req = draft_pb2.DraftServiceGenerateRequest(request_id="ref", prompt_ids=PROMPT_IDS,
                                                    sampling=S(max_new_tokens=300, ignore_eos=True))
        return [t for m in draft_pb2_grpc.DraftServiceStub(ch).Generate(req, timeout=120) for t in m.token_ids]


def test_reliability_bad_input_every_service(stack):
    target, draft, gateway = stack
    reference = _reference(draft.addr)
    background = _Background(draft.addr)
    with grpc.insecure_channel(target.addr) as tch, grpc.insecure_channel(draft.addr) as dch, \
            grpc.insecure_channel(gateway.addr) as gch:
        tstub = target_pb2_grpc.TargetServiceStub(tch)
        tstub.Prefill(target_pb2.PrefillRequest(request_id="live", prompt_ids=PROMPT_IDS), timeout=30)
        for case in TARGET_CASES:
            _expect(tstub, case)
        released = tstub.Release(target_pb2.ReleaseRequest(request_ids=["live", "never-seen", "live"]), timeout=30)
        assert released.num_released == 1  # idempotent: unknown and already-freed ids are skipped
        dstub = draft_pb2_grpc.DraftServiceStub(dch)
        for case in DRAFT_CASES:
            _expect(dstub, case)
        assert not dstub.Abort(draft_pb2.AbortRequest(request_id="nobody"), timeout=30).found
        gstub = gateway_pb2_grpc.GatewayServiceStub(gch)
        for case in GATEWAY_CASES:
            _expect(gstub, case)
    assert background.result() == reference  # the good request next to all of it: same tokens, all of them
    for addr, name in ((target.addr, TARGET_HEALTH), (draft.addr, DRAFT_HEALTH), (gateway.addr, GATEWAY_HEALTH)):
        assert health(addr, name) == SERVING
    free, total, running = wait_whole(target_kv, target.addr)
    assert (free, running) == (total, 0)
    free, total, running = wait_whole(draft_kv, draft.addr)
    assert (free, running) == (total, 0)


def test_reliability_bad_input_duplicate_running_ids(stack):
    target, draft, _ = stack
    long = S(max_new_tokens=400, ignore_eos=True)
    with grpc.insecure_channel(target.addr) as tch, grpc.insecure_channel(draft.addr) as dch:
        dstub = draft_pb2_grpc.DraftServiceStub(dch)
        tstub = target_pb2_grpc.TargetServiceStub(tch)
        running = dstub.Generate(draft_pb2.DraftServiceGenerateRequest(request_id="dup", prompt_ids=PROMPT_IDS,
                                                                       sampling=long), timeout=60)
        next(iter(running))
        _expect(dstub, ("duplicate", "Generate", draft_pb2.DraftServiceGenerateRequest(
            request_id="dup", prompt_ids=PROMPT_IDS), EXISTS, "already running"))
        plain = tstub.Generate(target_pb2.TargetServiceGenerateRequest(request_id="tdup", prompt_ids=PROMPT_IDS,
                                                                       sampling=long), timeout=60)
        next(iter(plain))
        _expect(tstub, ("duplicate", "Generate", target_pb2.TargetServiceGenerateRequest(
            request_id="tdup", prompt_ids=PROMPT_IDS), EXISTS, "already running"))
        assert dstub.Abort(draft_pb2.AbortRequest(request_id="dup"), timeout=10).found
        plain.cancel(), running.cancel()
    assert wait_whole(target_kv, target.addr)[2] == 0 and wait_whole(draft_kv, draft.addr)[2] == 0


def test_reliability_bad_input_oversized_message(stack):
    """A message over the 256 MiB limit is refused by the transport (RESOURCE_EXHAUSTED); the service goes on."""
    target, _, _ = stack
    with grpc.insecure_channel(target.addr) as ch:
        raw = ch.unary_unary("/specdec.v1.TargetService/Prefill")
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\x0a" + b"\x00" * (256 * 1024 * 1024 + 16), timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.details()
    assert health(target.addr, TARGET_HEALTH) == SERVING


# Bytes that are not the request message: a string field 1 (tag 0x0a, length) with invalid UTF-8, and garbage
MALFORMED_BYTES = [b"\x0a\x09abc\xed\xa0\x80def", b"\xff\xfe\xfd\x07\x00\x13"]
# (service: 0 target, 1 draft, 2 gateway; method; server-streaming)
RAW_METHODS = [(0, "/specdec.v1.TargetService/Prefill", False), (0, "/specdec.v1.TargetService/Generate", True),
               (1, "/specdec.v1.DraftService/Generate", True), (2, "/specdec.v1.GatewayService/Generate", True),
               (2, "/specdec.v1.GatewayService/Tokenize", False)]


def test_reliability_bad_input_malformed_bytes(stack, caplog):
    """INVALID_ARGUMENT "malformed request: ..." (not UNKNOWN), no traceback in the log, one gateway access-log
    line per refused gateway call, and every service still healthy with all its pages free."""
    for name in ("grpc", "specdec", "gateway"):
        caplog.set_level(logging.DEBUG, logger=name)
    for service, method, streaming in RAW_METHODS:
        with grpc.insecure_channel(stack[service].addr) as ch:
            call = ch.unary_stream(method) if streaming else ch.unary_unary(method)  # raw bytes both ways
            for payload in MALFORMED_BYTES:
                with pytest.raises(grpc.RpcError) as err:
                    list(call(payload, timeout=30)) if streaming else call(payload, timeout=30)
                assert err.value.code() == INVALID, f"{method}: {err.value.code()} {err.value.details()}"
                assert err.value.details().startswith("malformed request: "), err.value.details()
    tracebacks = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not tracebacks, tracebacks
    access = _access_lines(caplog, "INVALID_ARGUMENT", 2 * len(MALFORMED_BYTES))
    assert len(access) == 2 * len(MALFORMED_BYTES), access
    target, draft, gateway = stack
    for addr, name in ((target.addr, TARGET_HEALTH), (draft.addr, DRAFT_HEALTH), (gateway.addr, GATEWAY_HEALTH)):
        assert health(addr, name) == SERVING
    assert wait_whole(target_kv, target.addr)[2] == 0 and wait_whole(draft_kv, draft.addr)[2] == 0


def _access_lines(caplog, fragment: str, expected: int, timeout_s: float = 5.0) -> list[str]:
    """The gateway's access-log lines holding `fragment`, waited for until `expected` are there: `context.abort`
    sends the status before the access log's wrapper writes its line, so the client can see the status first."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == "gateway.access" and fragment in r.getMessage()]
        if len(lines) >= expected or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


@pytest.mark.parametrize("dtype,shape,nbytes,fragment", [
    ("int8", [2, 4], 8, "not one of"),
    ("float32", [2, 4], 31, "needs 32"),
    ("bfloat16", [2, -4], 0, "negative dimension"),
    ("float16", [3, 4], 24, "expected 2 rows"),
    ("float32", [2, 5], 40, "expected last dimension 4"),
])
def test_reliability_bad_input_hidden_state_blobs(dtype, shape, nbytes, fragment):
    msg = common_pb2.Tensor(dtype=dtype, shape=shape, data=b"\x00" * nbytes)
    with pytest.raises(InvalidInput, match=fragment.replace("(", r"\(")):
        tensor_from_proto(msg, expected_dim=4, expected_rows=2)
