"""`serve-draft --target in-process`: the draft service runs its target in its own process and serves
TargetService over that engine on the same server (draft_service/colocated.py)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from repo_paths import TINY
from services_stack import ServiceThread, start_draft

from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

TEXTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef walk(path):\n"]


def _prompts() -> list[list[int]]:
    from specdec.tokenizer import load_tokenizer

    tok = load_tokenizer(TINY / "target")
    return [tok.encode(t) for t in TEXTS] + [list(range(40, 100))]


PROMPTS = _prompts()


def _colocated(*extra: str) -> ServiceThread:
    return start_draft("in-process", *extra)


async def _draft_generate(addr: str, rid: str, prompt: list[int], n: int, **sampling) -> list[int]:
    params = common_pb2.SamplingParams(max_new_tokens=n, ignore_eos=True, **sampling)
    async with grpc.aio.insecure_channel(addr) as ch:
        call = draft_pb2_grpc.DraftServiceStub(ch).Generate(
            draft_pb2.DraftServiceGenerateRequest(request_id=rid, prompt_ids=prompt, sampling=params))
        return [t async for m in call for t in m.token_ids]


async def _plain_generate(addr: str, rid: str, prompt: list[int], n: int) -> list[int]:
    params = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    async with grpc.aio.insecure_channel(addr) as ch:
        call = target_pb2_grpc.TargetServiceStub(ch).Generate(
            target_pb2.TargetServiceGenerateRequest(request_id=rid, prompt_ids=prompt, sampling=params))
        return [t async for m in call for t in m.token_ids]


async def _pools_whole(addr: str) -> tuple[bool, bool]:
    """(target pool whole and no request held, draft pool whole and none running), read over the wire."""
    async with grpc.aio.insecure_channel(addr) as ch:
        t = await target_pb2_grpc.TargetServiceStub(ch).GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest())
        d = await draft_pb2_grpc.DraftServiceStub(ch).GetModelInfo(draft_pb2.DraftServiceGetModelInfoRequest())
    return (t.kv.pages_free == t.kv.pages_total and t.num_running == 0,
            d.kv.pages_free == d.kv.pages_total and d.num_running == 0)


async def _until_whole(addr: str, timeout_s: float = 5.0) -> tuple[bool, bool]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        whole = await _pools_whole(addr)
        if all(whole) or loop.time() > deadline:
            return whole
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def colocated():
    svc = _colocated()
    yield svc
    svc.stop()


def test_one_server_serves_both_and_speculation_is_the_targets_greedy_text(colocated):
    """Both services SERVING on the one port; the draft's speculative greedy tokens equal the same engine's plain
    decoding through its TargetService, for several prompts at once."""
    with grpc.insecure_channel(colocated.addr) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "specdec.v1.DraftService", "specdec.v1.TargetService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == \
                health_pb2.HealthCheckResponse.SERVING
        info = draft_pb2_grpc.DraftServiceStub(ch).GetModelInfo(draft_pb2.DraftServiceGetModelInfoRequest())
        tinfo = target_pb2_grpc.TargetServiceStub(ch).GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest())
        # the names `serve-target --model` gives; without --num-pages the draft's pool has the target's page count
        assert info.target == tinfo.model == str(TINY / "target")
        assert info.kv.pages_total == tinfo.kv.pages_total

    async def run():
        spec = await asyncio.gather(*[_draft_generate(colocated.addr, f"s{i}", p, 48, temperature=0.0)
                                      for i, p in enumerate(PROMPTS)])
        plain = await asyncio.gather(*[_plain_generate(colocated.addr, f"p{i}", p, 48)
                                       for i, p in enumerate(PROMPTS)])
        return spec, plain, await _until_whole(colocated.addr)

    spec, plain, whole = asyncio.run(run())
    assert spec == plain and all(len(t) == 48 for t in spec)
    assert whole == (True, True)


def test_a_remote_draft_shares_the_in_process_target(colocated):
    """A second draft service verifying through the colocated server's TargetService, while the colocated draft runs
    its own requests on the same engine (the two engine threads take turns): every output is the target's greedy
    text, and afterwards both pools are whole."""
    remote = start_draft(colocated.addr)
    try:
        async def run():
            jobs = [_draft_generate(colocated.addr, f"own{i}", p, 40, temperature=0.0) for i, p in enumerate(PROMPTS)]
            jobs += [_draft_generate(remote.addr, f"far{i}", p, 40, temperature=0.0) for i, p in enumerate(PROMPTS)]
            outs = await asyncio.gather(*jobs)
            plain = await asyncio.gather(*[_plain_generate(colocated.addr, f"ref{i}", p, 40)
                                           for i, p in enumerate(PROMPTS)])
            return outs, plain, await _until_whole(colocated.addr)

        outs, plain, whole = asyncio.run(run())
        assert outs == plain + plain
        assert whole == (True, True)
    finally:
        remote.stop()


def test_a_cancelled_stream_frees_both_pools(colocated):
    async def run():
        task = asyncio.ensure_future(_draft_generate(colocated.addr, "gone", PROMPTS[2], 2000, temperature=0.0))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await _until_whole(colocated.addr)

    assert asyncio.run(run()) == (True, True)


def test_sampled_requests_and_bad_input_on_the_colocated_server(colocated):
    """A sampled request runs (its tokens in the vocabulary); bad input gets INVALID_ARGUMENT from either service
    (the target's refusals of a draft's request say `target:`, as a remote target's do) and the server keeps
    serving."""
    async def run():
        sampled = await _draft_generate(colocated.addr, "t", PROMPTS[0], 24, temperature=0.8, seed=3)
        codes = []
        async with grpc.aio.insecure_channel(colocated.addr) as ch:
            for call in (
                draft_pb2_grpc.DraftServiceStub(ch).Generate(draft_pb2.DraftServiceGenerateRequest(
                    request_id="bad", prompt_ids=[10**6], sampling=common_pb2.SamplingParams(max_new_tokens=4))),
                target_pb2_grpc.TargetServiceStub(ch).Generate(target_pb2.TargetServiceGenerateRequest(
                    request_id="bad2", prompt_ids=[], sampling=common_pb2.SamplingParams(max_new_tokens=4))),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
                codes.append(err.value.code())
            try:
                await target_pb2_grpc.TargetServiceStub(ch).Verify(target_pb2.VerifyRequest(trees=[
                    target_pb2.TreeProposal(request_id="nobody", draft_tokens=[5], parents=[-1])]))
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
            # an id another caller holds on the target: the draft's client is told the target refused it
            await target_pb2_grpc.TargetServiceStub(ch).Prefill(target_pb2.PrefillRequest(
                request_id="held", prompt_ids=PROMPTS[2]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _draft_generate(colocated.addr, "held", PROMPTS[2], 4)
            codes.append((err.value.code(), err.value.details()))
            await target_pb2_grpc.TargetServiceStub(ch).Release(target_pb2.ReleaseRequest(request_ids=["held"]))
        after = await _draft_generate(colocated.addr, "after", PROMPTS[1], 8, temperature=0.0)
        return sampled, codes, after, await _until_whole(colocated.addr)

    sampled, codes, after, whole = asyncio.run(run())
    assert len(sampled) == 24 and all(0 <= t < 8192 for t in sampled)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                     (grpc.StatusCode.ALREADY_EXISTS, "target: request 'held' is already running")]
    assert len(after) == 8 and whole == (True, True)


@pytest.mark.parametrize("flags, message", [
    (["--feature-wire", "fp8"], "drop --feature-wire"),
    (["--target-tls-ca", str(TINY / "target" / "config.json")], "drop the --target-tls-\\* flags"),
    (["--target-wait-seconds", "30"], "nothing to wait for; drop --target-wait-seconds"),
])
def test_flags_for_a_remote_target_are_refused(flags, message):
    with pytest.raises(RuntimeError, match=message):
        _colocated(*flags)


def test_the_in_process_target_releases_requests_no_call_names():
    """`--request-idle-seconds` reaches the in-process TargetService's sweep (a request a remote draft prefilled and
    left is released); with a remote target the flag is refused (that target takes it itself)."""
    svc = _colocated("--request-idle-seconds", "0.5")
    try:
        async def run():
            async with grpc.aio.insecure_channel(svc.addr) as ch:
                stub = target_pb2_grpc.TargetServiceStub(ch)
                await stub.Prefill(target_pb2.PrefillRequest(request_id="left", prompt_ids=PROMPTS[0]))
                held = (await stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest())).num_running
            return held, await _until_whole(svc.addr, timeout_s=10.0)

        held, whole = asyncio.run(run())
    finally:
        svc.stop()
    assert held == 1 and whole == (True, True)
    with pytest.raises(RuntimeError, match="--request-idle-seconds is the in-process target's"):
        start_draft("127.0.0.1:1", "--request-idle-seconds", "5")


def test_metrics_show_the_in_process_target_beside_the_draft():
    """One /metrics with both services' series: the target's KV pool and running requests under service="target"
    (serve-target's families), the draft's under service="draft"."""
    import socket
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    svc = _colocated("--metrics-port", str(port), "--num-pages", "300")
    try:
        asyncio.run(_plain_generate(svc.addr, "m", PROMPTS[0], 8))
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        svc.stop()
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("specdec:") and " " in line}
    target = f'model_name="{TINY.joinpath("target").name}",service="target"'
    assert series[f"specdec:kv_pages_free{{{target}}}"] == 300
    assert series[f"specdec:num_requests_running{{{target}}}"] == 0
    assert series['specdec:kv_pages_free{model_name="draft",service="draft"}'] == 300


def test_draft_requests_get_pages_in_turn_beside_busy_plain_clients():
    """Four clients keep the in-process target's plain Generate busy on a pool that holds four requests while four
    speculative requests arrive: each of those is admitted in its turn (the target's page queue, shared by both
    callers) well within its 6 s wait limit. QA saw 0-1 of 4 admitted before, the rest RESOURCE_EXHAUSTED."""
    svc = _colocated("--num-pages", "40", "--max-queue-wait-seconds", "6")
    try:
        async def run():
            stop = asyncio.Event()

            async def busy(i: int) -> int:
                n = 0
                while not stop.is_set():
                    await _plain_generate(svc.addr, f"busy-{i}-{n}", PROMPTS[i % 3], 60)
                    n += 1
                return n

            clients = [asyncio.create_task(busy(i)) for i in range(4)]
            await asyncio.sleep(1.0)  # the pool is full of plain requests
            drafts = await asyncio.gather(*(_draft_generate(svc.addr, f"spec-{i}", PROMPTS[i], 60) for i in range(4)),
                                          return_exceptions=True)
            stop.set()
            return drafts, await asyncio.gather(*clients), await _until_whole(svc.addr, timeout_s=10.0)

        drafts, plain_counts, whole = asyncio.run(run())
    finally:
        svc.stop()
    assert [d if isinstance(d, Exception) else len(d) for d in drafts] == [60] * 4
    assert min(plain_counts) >= 1 and whole == (True, True)


@pytest.mark.parametrize("frozen", ["target", "draft"])
def test_a_stall_names_the_engine_thread_it_is_in(monkeypatch, caplog, frozen):
    """With the target in-process, a stall of the TargetService's engine thread (holding the target engine while
    the draft's step waits for it) was logged as the draft's engine thread's (QA); a stall of the draft's own step
    is the draft's."""
    import logging
    import threading

    from specdec.engine.draft_engine import DraftEngine
    from specdec.engine.target_engine import TargetEngine

    cls, method, thread = ((TargetEngine, "verify", "target-engine") if frozen == "target"
                           else (DraftEngine, "propose", "draft-engine"))
    real, armed = getattr(cls, method), threading.Event()

    def slow(self, *args, **kwargs):
        if threading.current_thread().name == thread and armed.is_set():
            armed.clear()
            threading.Event().wait(3.0)  # a hung kernel, say
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, slow)
    caplog.set_level(logging.ERROR, logger="specdec.serving.stall_watch")
    svc = _colocated("--engine-stall-seconds", "1")
    try:
        armed.set()

        async def body():
            plain = asyncio.ensure_future(_plain_generate(svc.addr, "p", PROMPTS[0], 4))
            await asyncio.sleep(0.3)
            return await asyncio.gather(plain, _draft_generate(svc.addr, "d", PROMPTS[1], 4))

        plain, drafted = asyncio.run(body())
    finally:
        svc.stop()
    assert len(plain) == 4 and len(drafted) == 4
    said = [r.getMessage() for r in caplog.records if "has been in one step" in r.getMessage()]
    name = "the in-process target's engine thread" if frozen == "target" else "the draft's engine thread"
    assert said and all(m.startswith(f"{name} has been in one step for over 1 s") for m in said), said
