"""The draft's start-up warm-up of the target's verify shapes: every shape once, nothing left behind."""

from __future__ import annotations

import pytest
from core_engines import tiny_target

from specdec.engine.warmup import warm_verify_shapes, warmup_trees
from specdec.errors import InvalidInput, NotReady
from specdec.request_ids import WARMUP_PREFIX
from specdec.rpc.target_codec import check_request_id
from specdec.tree import is_chain


def test_warmup_trees_cover_plain_steps_chains_and_branching_trees():
    assert warmup_trees([2, 5], 1) == [[], [-1, 0], [-1, 0, 1, 2, 3]]
    trees = warmup_trees([4, 4, 1], 3)
    assert trees[0] == [] and sorted(len(p) for p in trees[1:]) == [1, 4, 4]
    assert [is_chain(p) for p in trees[1:]] == [True, False, True]


class Recording:
    def __init__(self, target):
        self.target, self.shapes = target, []

    def prefill(self, inputs):
        return self.target.prefill(inputs)

    def verify(self, inputs):
        self.shapes.append(inputs[0].parents)
        return self.target.verify(inputs)

    def release(self, rid):
        return self.target.release(rid)


def test_warm_verify_shapes_sends_each_shape_once_and_frees_its_request():
    target = tiny_target()
    free = target.kv.num_free_pages
    rec = Recording(target)
    warm_verify_shapes(rec, [2, 5], 2, (), target.cfg.vocab_size)
    assert rec.shapes == warmup_trees([2, 5], 2)
    assert not target.requests and target.kv.num_free_pages == free


def test_a_target_that_fails_does_not_stop_the_warm_up_from_returning(caplog):
    class Down:
        def prefill(self, inputs):
            raise NotReady("target: connection refused")

    warm_verify_shapes(Down(), [5], 1, (), 100)
    assert "warm-up skipped" in caplog.text


def test_a_client_may_not_name_its_request_with_the_warm_up_prefix_but_the_warm_up_may():
    """The services' Generate (a client's id) refuses `__warmup-`; Prefill/Verify/Release, which the warm-up
    itself goes through, keep accepting it."""
    rid = f"{WARMUP_PREFIX}0123456789ab"
    assert check_request_id(rid) == rid
    with pytest.raises(InvalidInput, match="must not start with '__warmup-'"):
        check_request_id(rid, chosen_by_client=True)
    assert check_request_id("warmup-but-not-reserved", chosen_by_client=True) == "warmup-but-not-reserved"
