"""Requests that end while the draft's target is away are released on it once it answers again
(`draft_service.pending_release`, `TargetClient.release_pending`): a target that lived through a stall or a cut link
no longer holds their pages and ids until its idle sweep (120 s)."""

from __future__ import annotations

import pytest
from services_stack import start_target

from draft_service.pending_release import PendingReleases
from draft_service.target_client import TargetClient
from specdec.engine.requests import PrefillInput
from specdec.errors import DuplicateRequest
from specdec.sampling_params import SamplingParams

PROMPT = [1, 331, 288, 1093, 297, 40, 77, 12]


def test_pending_ids_are_taken_once_oldest_dropped_past_the_cap():
    pending = PendingReleases(max_ids=3)
    pending.add(["a", "b"])
    pending.add(["c", "a", "d"])  # "a" again: now the newest; "b" the oldest, dropped at the cap
    assert len(pending) == 3
    assert pending.take(["a", "x"]) == ["a"] and pending.take(["a"]) == []
    assert pending.take() == ["c", "d"] and len(pending) == 0


@pytest.fixture(scope="module")
def target():
    service = start_target()
    yield service
    service.stop()


def _prefill(client: TargetClient, rid: str):
    return client.prefill([PrefillInput(rid, PROMPT, SamplingParams(max_new_tokens=8), return_features=False)])


def test_released_once_the_target_answers_and_an_id_taken_again_is_freed_first(target):
    client = TargetClient(target.addr, timeout_s=10.0, features=False)
    try:
        free0 = client.model_info().kv.pages_free
        _prefill(client, "gone-1")
        _prefill(client, "gone-2")
        info = client.model_info()
        assert info.num_running == 2 and info.kv.pages_free < free0
        with pytest.raises(DuplicateRequest):  # what a new request under an id the target still holds meets
            _prefill(client, "gone-2")
        client.release_later(["gone-1", "gone-2"])  # their verify failed with the target away (NotReady)
        _prefill(client, "gone-2")  # a new request under a pending id: the old one is released first
        assert len(client.pending) == 1
        assert client.release_pending() == 1 and len(client.pending) == 0
        info = client.model_info()
        assert info.num_running == 1  # the new "gone-2" only
        client.release("gone-2")
        assert client.model_info().kv.pages_free == free0
    finally:
        client.close()


def test_a_release_the_target_is_away_for_is_kept_and_a_failed_retry_keeps_it():
    client = TargetClient("127.0.0.1:1", timeout_s=2.0)  # nothing listens there
    try:
        client.release("r1")  # no error: kept for later
        assert client.pending.take(["r1"]) == ["r1"]
        client.release_later(["r2"])
        assert client.release_pending(timeout_s=1.0) == 0 and len(client.pending) == 1
    finally:
        client.close()
