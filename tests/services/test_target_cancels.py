"""A target that ends the draft's call with CANCELLED is a target away, not the request's client leaving: a grpc
server that stops cancels the calls it has taken and not yet handed to a handler (QA: a rolling restart under load).
Before, the draft read that status as its own cancel (`Cancelled`): a Prefill's request was dropped as if its client
had left, and the target watch was not told."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from draft_service.target_client import TargetClient
from specdec.engine.requests import PrefillInput, VerifyInput
from specdec.errors import Cancelled, NotReady
from specdec.sampling_params import SamplingParams

SERVICE = "specdec.v1.TargetService"


def _cancelling_target() -> tuple[grpc.Server, int, list[str]]:
    """A target whose Prefill and Verify end with the status a stopping grpc server gives a call it took."""
    seen: list[str] = []

    def cancel(request, context):
        seen.append("call")
        context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")

    handler = grpc.method_handlers_generic_handler(SERVICE, {
        name: grpc.unary_unary_rpc_method_handler(cancel) for name in ("Prefill", "Verify")})
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port, seen


@pytest.mark.parametrize("method", ["prefill", "verify"])
def test_a_call_the_target_cancels_is_the_target_away(method):
    server, port, seen = _cancelling_target()
    client = TargetClient(f"127.0.0.1:{port}", timeout_s=5.0, features=False)
    nudged: list[int] = []
    client.on_unreachable = lambda: nudged.append(1)
    try:
        with pytest.raises(NotReady) as err:
            if method == "prefill":
                client.prefill([PrefillInput("r", [1, 2, 3], SamplingParams(max_new_tokens=4), (), False)])
            else:
                client.verify([VerifyInput("r", [5], [-1])])
        assert not isinstance(err.value, Cancelled)
        assert str(err.value).startswith("target: ") and err.value.status == "UNAVAILABLE"
        assert seen and nudged  # the target watch looks at once, as for a target that refused the connection
    finally:
        client.close()
        server.stop(None)
