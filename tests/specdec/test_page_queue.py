"""The target's KV pages go to requests in the order they were first refused, whichever caller sends them (its own
Generate scheduler, a draft's Prefill, the draft in its process): a request that comes later is refused while an
earlier one waits, even where it would fit; a waiting request nobody asks for again loses its place."""

from __future__ import annotations

import pytest
from repo_paths import TINY

from specdec.engine.factory import EngineOptions, build_target
from specdec.engine.page_queue import PageQueue
from specdec.engine.requests import PrefillInput
from specdec.engine.scheduler import Scheduler
from specdec.errors import InvalidInput, OutOfPages, UnknownRequest
from specdec.sampling_params import SamplingParams

# 10 prompt + 20 new tokens + a tree of 64 drafts + 1 = 95 token slots: 6 pages of 16; the pool holds two requests
POOL_PAGES = 12
PROMPT = list(range(3, 13))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engine():
    return build_target(str(TINY / "target"), EngineOptions(num_pages=POOL_PAGES, max_batch_size=8))


@pytest.fixture
def clock(engine):
    clock = Clock()
    engine.page_queue = PageQueue(clock=clock)
    yield clock
    for rid in list(engine.requests):
        engine.release(rid)


def ask(engine, *rids: str, new_tokens: int = 20, queue: bool = True):
    """What a caller that waits for pages sends (`queue`: it will ask again when refused)."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    return engine.prefill([PrefillInput(rid, PROMPT, params, (), queue_for_pages=queue) for rid in rids])


def refused(engine, *rids: str, new_tokens: int = 20, queue: bool = True) -> str:
    with pytest.raises(OutOfPages) as err:
        ask(engine, *rids, new_tokens=new_tokens, queue=queue)
    return str(err.value)


def test_a_later_request_waits_behind_an_earlier_one_even_where_it_fits(engine, clock):
    ask(engine, "a")
    ask(engine, "b")
    assert "unreserved" in refused(engine, "c")  # the pool is full: c waits first
    engine.release("a")  # room for one
    assert refused(engine, "d") == "KV pool full: 1 earlier request wait for pages"
    ask(engine, "c")  # c's caller asks again: its turn
    assert "unreserved" in refused(engine, "d")  # full again; d is first now
    engine.release("b")
    ask(engine, "d")
    assert len(engine.page_queue) == 0
    assert engine.kv.reserved_by_requests == POOL_PAGES


def test_a_caller_that_will_not_ask_again_keeps_no_place_but_waits_its_turn(engine, clock):
    ask(engine, "a")
    ask(engine, "b")
    assert "unreserved" in refused(engine, "once", queue=False)  # e.g. --max-queue-wait-seconds 0
    assert len(engine.page_queue) == 0
    refused(engine, "w")
    engine.release("a")
    assert "1 earlier request" in refused(engine, "once", queue=False)  # w was first and will ask again
    ask(engine, "w")


def test_a_waiting_request_nobody_asks_for_loses_its_place(engine, clock):
    ask(engine, "a")
    ask(engine, "b")
    refused(engine, "gone")  # its caller gives up (a client that left) and never asks again
    engine.release("a")
    clock.now += 0.2
    assert "earlier request" in refused(engine, "e")
    clock.now += engine.page_queue.lapse_s
    ask(engine, "e")
    assert "gone" not in engine.page_queue


def test_asking_again_keeps_the_place(engine, clock):
    ask(engine, "a")
    ask(engine, "b")
    refused(engine, "first")
    refused(engine, "second")
    for _ in range(5):  # both callers keep asking for longer than the lapse
        clock.now += engine.page_queue.lapse_s * 0.8
        assert "unreserved" in refused(engine, "first")
        assert "1 earlier request" in refused(engine, "second")
    engine.release("a")
    assert "1 earlier request" in refused(engine, "second")
    ask(engine, "first")


def test_a_refused_group_queues_its_requests_when_asked_one_at_a_time(engine, clock):
    ask(engine, "a")
    refused(engine, "g1", "g2")  # g1 fits, g2 does not: all or nothing
    assert len(engine.page_queue) == 0  # the caller asks for them one at a time next, in its order
    ask(engine, "g1")
    assert "unreserved" in refused(engine, "g2")
    assert list(engine.page_queue._seen) == ["g2"]


def test_waiting_requests_admitted_together_do_not_wait_for_each_other(engine, clock):
    ask(engine, "a")
    ask(engine, "b")
    refused(engine, "w1")
    refused(engine, "w2")
    engine.release("a")
    engine.release("b")
    outs = ask(engine, "w1", "w2")
    assert [o.request_id for o in outs] == ["w1", "w2"] and len(engine.page_queue) == 0


def test_a_request_no_pool_could_hold_does_not_hold_up_the_others(engine, clock):
    ask(engine, "a")
    with pytest.raises(InvalidInput, match="too small for this request: it needs 30 pages") as err:
        ask(engine, "huge", new_tokens=400)  # 30 pages of a 12-page pool: refused at once, takes no place
    assert str(err.value).endswith("ask for at most 117 new tokens")  # 192 slots - 10 prompt - 65 tree
    long = SamplingParams(max_new_tokens=1, ignore_eos=True)
    with pytest.raises(InvalidInput, match="send a shorter prompt"):  # the prompt alone is too long
        engine.prefill([PrefillInput("long", list(range(3, 203)), long, ())])
    assert len(engine.page_queue) == 0
    ask(engine, "b")


def test_a_request_refused_for_another_reason_leaves_the_queue(engine, clock):
    ask(engine, "a")
    ask(engine, "b")
    refused(engine, "w")
    engine.release("a")
    with pytest.raises(InvalidInput):  # w's caller sends it again with a bad sampling setting
        engine.prefill([PrefillInput("w", PROMPT, SamplingParams(max_new_tokens=20, temperature=-1.0), (),
                                     queue_for_pages=True)])
    assert "w" not in engine.page_queue
    ask(engine, "c")


def test_a_callers_whole_queue_holds_its_places_in_its_order(engine, clock):
    """A caller asks again for its first waiting request only; the ones behind it hold places through
    `hold_places` (its scheduler, each time it finds the pool still full), ahead of another caller's later request."""
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ask(engine, "a")
    ask(engine, "b")
    refused(engine, "t1")  # the first of the target's own queue
    engine.hold_places([PrefillInput(rid, PROMPT, params) for rid in ("t1", "t2", "t3")])
    refused(engine, "d1")  # a draft's request, refused after them
    huge = SamplingParams(max_new_tokens=400, ignore_eos=True)  # no pool could hold it: no place
    engine.hold_places([PrefillInput("t1", PROMPT, params), PrefillInput("never", PROMPT, huge)])
    assert list(engine.page_queue._seen) == ["t1", "t2", "t3", "d1"]
    engine.release("a")
    engine.release("b")
    assert "3 earlier requests" in refused(engine, "d1")
    ask(engine, "t1", "t2")  # the caller's next group: both in their turn
    assert "1 earlier request" in refused(engine, "d1")


def test_releasing_a_waiting_request_gives_up_its_place_at_once(engine, clock):
    """A caller that gives up on a waiting request (its client left, its queue wait ran out) releases it: the
    requests behind it do not wait for its place to lapse."""
    ask(engine, "a")
    ask(engine, "b")
    refused(engine, "left")
    engine.release("left")  # no pages held: it leaves the queue
    assert "left" not in engine.page_queue
    engine.release("a")
    ask(engine, "next")  # at once, no lapse
    with pytest.raises(UnknownRequest):
        engine.release("left")  # gone now


@pytest.mark.parametrize("how", ["abort", "queue wait"])
def test_a_scheduler_gives_up_the_place_of_a_request_it_stops_waiting_for(engine, clock, how):
    """The target's own queue (a Scheduler over the engine, as `TargetService.Generate`): a waiting request aborted
    by its client, or whose queue wait ran out, leaves the page queue in the same step."""
    ask(engine, "a")
    ask(engine, "b")
    sched = Scheduler(engine, None, engine.max_context, 4, max_queue_wait_s=30.0)
    sched.add("w", PROMPT, SamplingParams(max_new_tokens=20, ignore_eos=True))
    sched.step()
    assert "w" in engine.page_queue and sched.waiting
    if how == "abort":
        sched.abort("w")
    else:
        sched.max_queue_wait_s = 1e-9  # (its wait has run out by the next step)
    events = sched.step()
    assert [e.request_id for e in events] == ["w"] and not sched.waiting
    assert "w" not in engine.page_queue
    engine.release("a")
    ask(engine, "next")


def test_the_targets_waiting_count_takes_both_queues_each_request_once(engine, clock):
    """`num_requests_waiting` on the target: plain Generate's queue and drafts' requests waiting for pages, a Generate
    request blocked in both counted once, a lapsed place not at all (QA: a draft's request waiting for the target's
    pages was in GetModelInfo's count but not in the gauge)."""
    ask(engine, "a")
    ask(engine, "b")
    refused(engine, "draft-1")  # a draft's request: a place in the page queue only
    sched = Scheduler(engine, None, engine.max_context, 4, max_queue_wait_s=30.0)
    sched.add("w", PROMPT, SamplingParams(max_new_tokens=20, ignore_eos=True))
    sched.add("w2", PROMPT, SamplingParams(max_new_tokens=20, ignore_eos=True))
    sched.step()  # "w" refused: in both queues; "w2" behind it in the scheduler's
    assert "w" in engine.page_queue and len(sched.waiting) == 2
    assert engine.page_queue.count_with(s.request_id for s in sched.waiting) == 3
    clock.now += 1.0  # the draft stopped asking: its place lapsed (and w's, whose next step asks again)
    assert engine.page_queue.count_with(s.request_id for s in sched.waiting) == 2
