"""A draft's readiness follows its remote target's (`draft_service.target_watch.TargetWatch`): NOT_SERVING after
`misses_down` unanswered GetModelInfo calls in a row or an answer that does not fit the draft, SERVING again once the
target answers and fits; each change logged once."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from draft_service.target_watch import TargetWatch
from specdec.errors import NotReady

GOOD = SimpleNamespace(model="tiny", hidden_size=384)
OTHER = SimpleNamespace(model="other", hidden_size=512)


class FakeTarget:
    addr = "target:1"

    def __init__(self) -> None:
        self.answers: list = []
        self.renewals = 0
        self.abandoned: list[str] = []

    def renew_channel(self) -> None:
        self.renewals += 1  # asked before every look (renewed TLS files: `TargetClient.renew_channel`)

    def abandon_calls(self, why: str) -> None:
        self.abandoned.append(why)

    def model_info(self, timeout_s=None):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def watch_over(answers: list) -> tuple[TargetWatch, list[bool]]:
    target = FakeTarget()
    target.answers = list(answers)
    misfit = lambda info: None if info.hidden_size == 384 else f"serves {info.model}, hidden {info.hidden_size}"  # noqa: E731
    watch = TargetWatch(target, misfit, interval_s=0.0, misses_down=2)
    reported: list[bool] = []

    async def set_ready(up: bool) -> None:
        reported.append(up)

    async def run() -> None:
        for _ in answers:
            await watch.check(set_ready)

    asyncio.run(run())
    return watch, reported


def test_one_unanswered_call_is_a_hiccup_two_in_a_row_take_the_draft_out_until_the_target_answers(caplog):
    away = NotReady("target: failed to connect")
    with caplog.at_level(logging.INFO, logger="draft_service.target_watch"):
        watch, reported = watch_over([GOOD, away, GOOD, away, away, away, away, GOOD, GOOD])
    assert reported == [False, True]
    assert watch.down is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # one line per change, none for the calls in between
    assert "target:1 does not answer" in lines[0] and "NOT_SERVING" in lines[0]
    assert "answers again (tiny)" in lines[1]
    assert watch.client.renewals == 9  # each look first renews the channel if the TLS files changed
    assert len(watch.client.abandoned) == 1  # calls still waiting for an unanswering target end at once


def test_each_new_reason_the_target_does_not_answer_is_logged_once(caplog):
    """While the target stays away, a new reason is worth a line (a target back with TLS where the draft speaks
    plaintext: the handshake hint; QA: the log kept `Connection refused`); the same reason again is not."""
    refused, closed = NotReady("target: Connection refused"), NotReady("target: Socket closed (if it serves TLS...)")
    with caplog.at_level(logging.INFO, logger="draft_service.target_watch"):
        watch, reported = watch_over([GOOD, refused, refused, refused, closed, closed, refused, GOOD])
    assert reported == [False, True]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "Connection refused" in lines[0] and "NOT_SERVING until" in lines[0]
    assert "Socket closed (if it serves TLS...)" in lines[1] and lines[1].endswith("(still NOT_SERVING)")
    assert "answers again" in lines[2]
    assert len(watch.client.abandoned) == 1


def test_a_target_restarted_as_another_model_takes_the_draft_out_until_a_fitting_one_answers(caplog):
    with caplog.at_level(logging.WARNING, logger="draft_service.target_watch"):
        watch, reported = watch_over([GOOD, OTHER, OTHER, OTHER, NotReady("x"), NotReady("y"), OTHER, GOOD])
    assert reported == [False, True]
    lines = [r.getMessage() for r in caplog.records]
    # the misfit, then it going away (a new reason), then the misfit again: each change once, no line per call
    assert len(lines) == 3 and "serves other, hidden 512" in lines[0] and "does not answer" in lines[1]
    assert watch.down is None


def test_a_request_that_missed_the_target_makes_the_watch_look_at_once():
    """A request's call that did not reach the target nudges the watch: it looks at once and again `RECHECK_S` later,
    so a killed target's draft reports NOT_SERVING within ~0.3 s of the first failed request, not 2-4 s (QA). Only
    the requests' calls nudge: the watch's own GetModelInfo does not (it would loop on a dead target)."""
    import time

    from draft_service.target_client import TargetClient
    from specdec.engine.requests import VerifyInput
    from specdec.errors import SpecdecError

    target = FakeTarget()
    target.answers = [NotReady("target: failed to connect"), NotReady("target: failed to connect")]
    watch = TargetWatch(target, lambda info: None, interval_s=30.0, misses_down=2)
    reported: list[tuple[bool, float]] = []

    async def scenario() -> None:
        async def set_ready(up: bool) -> None:
            reported.append((up, time.monotonic()))

        task = asyncio.create_task(watch.run(set_ready))
        await asyncio.sleep(0.5)  # no look yet: the interval is 30 s
        assert len(target.answers) == 2
        client = TargetClient("127.0.0.1:1", timeout_s=2.0)  # nothing listens there
        client.on_unreachable = watch.nudge
        with pytest.raises(SpecdecError):
            client.model_info(1.0)  # the watch's own kind of call: no nudge
        await asyncio.sleep(0.5)
        assert len(target.answers) == 2
        started = time.monotonic()
        with pytest.raises(SpecdecError):
            await asyncio.to_thread(client.verify, [VerifyInput("r", [], [])])
        client.close()
        for _ in range(100):
            if reported:
                break
            await asyncio.sleep(0.05)
        task.cancel()
        assert reported and not reported[0][0] and reported[0][1] - started < 2.0
        assert not target.answers  # the nudge's look and the one RECHECK_S after it: two misses in a row

    asyncio.run(scenario())


def test_a_draft_whose_target_misfits_refuses_new_requests_saying_why():
    """While the target answers but does not fit (another model, a smaller context than the draft was started for),
    `misfit` says why and the draft's Generate refuses new requests UNAVAILABLE with it; an unanswering target is not
    a misfit (its requests' own calls fail over). Before, a request was taken and failed part way with the target's
    INVALID_ARGUMENT "tree ... reaches past the context length" (QA)."""
    from draft_service.servicer import DraftServicer
    from specdec.v1 import draft_pb2

    watch, _ = watch_over([GOOD, OTHER])
    assert watch.misfit == "serves other, hidden 512"
    assert watch_over([GOOD, NotReady("x"), NotReady("y")])[0].misfit is None
    assert watch_over([OTHER, GOOD])[0].misfit is None

    servicer = DraftServicer("draft")
    servicer.max_context, servicer.vocab_size = 64, 100
    servicer.target_misfit = lambda: watch.misfit
    request = draft_pb2.DraftServiceGenerateRequest(request_id="r", prompt_ids=[1, 2, 3])

    async def first():
        return await anext(servicer._generate(request))

    with pytest.raises(NotReady, match="serves other, hidden 512: this draft takes no requests until its target"):
        asyncio.run(first())


def test_the_drafts_client_takes_the_part_size_of_the_target_that_answers_now():
    """QA: a target restarted with another `--prefill-chunk-tokens` (a rolling update) was admitted for with the
    part size of the one the draft had started against: against one that prefilled in one forward, a long prompt's
    admission kept blocking the draft's running streams for the whole prefill (their longest gap 2.0-2.8 s on a
    CPU, 0.3-0.7 s from a draft started against the restarted target). Each GetModelInfo answer (the target
    watch's, every 2 s) now sets it."""
    from dataclasses import replace

    from draft_service.target_client import TargetClient
    from specdec.v1 import target_pb2

    client = TargetClient("127.0.0.1:1")
    try:
        for chunk in (0, 512, 0):
            answer = target_pb2.TargetServiceGetModelInfoResponse(model="tiny", prefill_chunk_tokens=chunk)
            client._link = replace(client._link, model_info=lambda request, answer=answer, **kw: answer)
            client.model_info(1.0)
            assert client.prefill_chunk_tokens == chunk
    finally:
        client.close()
