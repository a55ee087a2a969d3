"""Admission control: a request the KV pool cannot hold now waits (FIFO) up to --max-queue-wait-seconds, then
fails RESOURCE_EXHAUSTED; a client deadline ends the wait early; nothing waits or leaks afterwards.

The target's pool is 30 pages of 16 tokens; a request of 10 prompt + 200 new tokens reserves 18 of them (its
tokens plus one full tree of 64 draft slots), so a second such request must wait for the first.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from reliability_support import PROMPT_IDS, draft_kv, start_draft, start_target, target_kv, wait_whole

from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


@pytest.fixture(scope="module")
def stack():
    target = start_target("--num-pages", "30", "--max-queue-wait-seconds", "20")
    waits = start_draft(target.addr, "--max-queue-wait-seconds", "20")
    short = start_draft(target.addr, "--max-queue-wait-seconds", "0.5")
    yield target, waits, short
    for s in (short, waits, target):
        s.stop()


def sampling(n: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_new_tokens=n, ignore_eos=True)


def draft_stream(addr: str, rid: str, n: int, timeout: float | None = 60):
    channel = grpc.insecure_channel(addr)
    stub = draft_pb2_grpc.DraftServiceStub(channel)
    req = draft_pb2.DraftServiceGenerateRequest(request_id=rid, prompt_ids=PROMPT_IDS, sampling=sampling(n))
    return stub.Generate(req, timeout=timeout), channel


def collect(call) -> tuple[list[int], float]:
    """All tokens of a stream and when its first chunk arrived."""
    tokens, first = [], None
    for msg in call:
        first = first or time.monotonic()
        tokens += msg.token_ids
    return tokens, first


def test_reliability_admission_waits_for_pages_then_runs(stack):
    target, waits, _ = stack
    holder, ch1 = draft_stream(waits.addr, "hold-1", 200)
    it = iter(holder)
    first_chunk = next(it)
    assert target_kv(target.addr)[2] == 1  # the holder runs (and has reserved 18 of the 30 pages)
    waiter, ch2 = draft_stream(waits.addr, "wait-1", 200)
    result = {}
    t = threading.Thread(target=lambda: result.update(zip(("tokens", "first"), collect(waiter), strict=True)))
    t.start()
    held = list(first_chunk.token_ids) + [tok for msg in it for tok in msg.token_ids]
    holder_done = time.monotonic()
    t.join(60)
    assert len(held) == 200 and result["tokens"] == held  # same greedy tokens, nothing lost
    assert result["first"] >= holder_done - 0.05  # it was admitted only once the holder's pages came back
    ch1.close(), ch2.close()
    assert wait_whole(target_kv, target.addr)[:2] == (30, 30)


def test_reliability_admission_gives_up_after_the_limit(stack):
    target, waits, short = stack
    holder, ch1 = draft_stream(waits.addr, "hold-2", 400)
    next(iter(holder))
    t0 = time.monotonic()
    waiter, ch2 = draft_stream(short.addr, "wait-2", 200)
    with pytest.raises(grpc.RpcError) as err:
        collect(waiter)
    waited = time.monotonic() - t0
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV pool full: waited" in err.value.details() and "limit 0.5 s" in err.value.details()
    assert 0.5 <= waited < 10
    never, ch3 = draft_stream(waits.addr, "never-fits", 1500)  # more pages than the whole pool holds
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        collect(never)
    # refused at once, named for what it is (it used to wait out the 20 s limit, then say "KV pool full")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and time.monotonic() - t0 < 5
    assert "too small for this request" in err.value.details() and "ask for at most" in err.value.details()
    holder.cancel()
    for ch in (ch1, ch2, ch3):
        ch.close()
    assert wait_whole(target_kv, target.addr)[:2] == (30, 30)
    assert wait_whole(draft_kv, short.addr)[2] == 0 and wait_whole(draft_kv, waits.addr)[2] == 0


def test_reliability_admission_deadline_ends_the_wait(stack):
    target, waits, _ = stack
    holder, ch1 = draft_stream(waits.addr, "hold-3", 400)
    next(iter(holder))
    waiter, ch2 = draft_stream(waits.addr, "wait-3", 200, timeout=0.7)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        collect(waiter)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 5
    holder.cancel()
    ch1.close(), ch2.close()
    # the waiting entry was dropped with the call: nothing is admitted later, every page comes back
    assert wait_whole(draft_kv, waits.addr)[2] == 0
    assert wait_whole(target_kv, target.addr) == (30, 30, 0)


def test_reliability_admission_target_plain_generate_waits_too(stack):
    target, waits, _ = stack
    holder, ch1 = draft_stream(waits.addr, "hold-4", 200)
    next(iter(holder))
    with grpc.insecure_channel(target.addr) as ch:
        stub = target_pb2_grpc.TargetServiceStub(ch)
        req = target_pb2.TargetServiceGenerateRequest(request_id="plain-wait", prompt_ids=PROMPT_IDS,
                                                      sampling=sampling(200))
        tokens = [t for msg in stub.Generate(req, timeout=60) for t in msg.token_ids]
    assert len(tokens) == 200
    ch1.close()
    assert wait_whole(target_kv, target.addr) == (30, 30, 0)


def test_reliability_admission_pages_go_in_turn_across_callers(stack):
    """A draft's request refused for lack of pages comes before a plain Generate that arrives later on the target
    (two queues on one pool: whichever retried first used to take the pages; QA saw 0-1 of 4 draft requests
    admitted against 4 busy Generate clients). The pool holds one such request at a time."""
    target, waits, _ = stack
    holder, ch1 = draft_stream(waits.addr, "hold-5", 200)
    it = iter(holder)
    next(it)
    waiter, ch2 = draft_stream(waits.addr, "wait-5", 200)
    seen = {}
    t = threading.Thread(target=lambda: seen.update(zip(("draft", "draft_first"), collect(waiter), strict=True)))
    t.start()
    time.sleep(0.5)  # the draft's request is refused now (and asks again every 10 ms)

    def plain():
        with grpc.insecure_channel(target.addr) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            req = target_pb2.TargetServiceGenerateRequest(request_id="plain-5", prompt_ids=PROMPT_IDS,
                                                          sampling=sampling(200))
            seen["plain"], seen["plain_first"] = collect(stub.Generate(req, timeout=60))

    p = threading.Thread(target=plain)
    p.start()
    for _ in it:
        pass
    t.join(60), p.join(60)
    assert len(seen["draft"]) == 200 and len(seen["plain"]) == 200
    assert seen["draft_first"] < seen["plain_first"]  # in turn: the draft's request first
    ch1.close(), ch2.close()
    assert wait_whole(target_kv, target.addr) == (30, 30, 0)


def test_reliability_admission_a_queue_behind_its_first_request_keeps_its_turn(stack):
    """Two plain Generate requests wait on the target (the second behind the first in the target's own queue), then
    a draft's request arrives: it is served after both (QA: the second plain one was passed by every later draft
    request, whose Prefills each hold a place, and timed out behind them)."""
    target, waits, _ = stack
    holder, ch1 = draft_stream(waits.addr, "hold-6", 200)
    it = iter(holder)
    next(it)
    seen, threads = {}, []

    def plain(rid):
        with grpc.insecure_channel(target.addr) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            req = target_pb2.TargetServiceGenerateRequest(request_id=rid, prompt_ids=PROMPT_IDS, sampling=sampling(200))
            seen[rid] = collect(stub.Generate(req, timeout=60))

    def speculative(rid):
        call, ch = draft_stream(waits.addr, rid, 200)
        seen[rid] = collect(call)
        ch.close()

    for fn, rid in ((plain, "plain-6a"), (plain, "plain-6b"), (speculative, "spec-6")):
        threads.append(threading.Thread(target=fn, args=(rid,)))
        threads[-1].start()
        time.sleep(0.3)  # each is refused (the pool is full) before the next one arrives
    for _ in it:
        pass
    for t in threads:
        t.join(60)
    assert [len(seen[r][0]) for r in ("plain-6a", "plain-6b", "spec-6")] == [200] * 3  # 18 pages: one at a time
    firsts = sorted(("plain-6a", "plain-6b", "spec-6"), key=lambda r: seen[r][1])
    assert firsts == ["plain-6a", "plain-6b", "spec-6"]  # in the order they arrived, across the two queues
    ch1.close()
    assert wait_whole(target_kv, target.addr) == (30, 30, 0)


def waiting_for_pages(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        info = target_pb2_grpc.TargetServiceStub(ch).GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(),
                                                                   timeout=10)
    return info.num_waiting_for_pages


def test_reliability_admission_a_cancelled_waiting_request_gives_up_its_place_at_once(stack):
    """A draft's request waiting for the target's pages is cancelled by its client: the draft releases it on the
    target, whose page queue drops it at once instead of after its place lapses (0.5 s of holding up every request
    behind it; QA saw a cancel right as pages came back delay the others that long)."""
    target, waits, _ = stack
    holder, ch1 = draft_stream(waits.addr, "hold-7", 200)
    it = iter(holder)
    next(it)
    waiter, ch2 = draft_stream(waits.addr, "gone-7", 200)
    deadline = time.monotonic() + 10
    while waiting_for_pages(target.addr) == 0 and time.monotonic() < deadline:  # refused: its place on the target
        time.sleep(0.01)
    assert waiting_for_pages(target.addr) == 1
    waiter.cancel()
    t0 = time.monotonic()
    while waiting_for_pages(target.addr) and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    gone_after = time.monotonic() - t0
    assert waiting_for_pages(target.addr) == 0
    assert gone_after < 0.4, gone_after  # the draft's next step released it (a lapse takes 0.5 s after its last ask)
    holder.cancel()
    ch1.close(), ch2.close()
    assert wait_whole(target_kv, target.addr) == (30, 30, 0)
