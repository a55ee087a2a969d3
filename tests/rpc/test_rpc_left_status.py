"""How a cancelled call is recorded (access log, metrics, spans): a deadline or the client leaving."""

from __future__ import annotations

import grpc
import pytest

from specdec.rpc.metadata import DEADLINE_SLACK_S, left_status


class _Context:
    def __init__(self, remaining):
        self._remaining = remaining

    def time_remaining(self):
        return self._remaining


@pytest.mark.parametrize("remaining, status", [
    (None, grpc.StatusCode.CANCELLED),  # no deadline: the client left
    (5.0, grpc.StatusCode.CANCELLED),
    (-0.01, grpc.StatusCode.DEADLINE_EXCEEDED),
    (0.004, grpc.StatusCode.DEADLINE_EXCEEDED),  # the client's own timer cancelled it a little before the server's
    (DEADLINE_SLACK_S + 0.05, grpc.StatusCode.CANCELLED),
])  # fmt: skip
def test_a_cancel_at_the_deadline_is_recorded_as_the_deadline(remaining, status):
    assert left_status(_Context(remaining)) is status
