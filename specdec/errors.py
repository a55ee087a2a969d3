"""Errors the engines raise, each naming the gRPC status the service edge maps it to.

Engines never import grpc; `specdec.rpc` turns these into status codes with the message unchanged.
"""

from __future__ import annotations

# how a draft's message begins when its target caused the error (refused, away, stalled, a malformed reply): a gateway
# then moves the request off the pair rather than onto the same target (`gateway.fallback`)
TARGET_PREFIX = "target: "


class SpecdecError(Exception):
    """Base class; `status` is the name of a `grpc.StatusCode` member."""

    status = "INTERNAL"


class InvalidInput(SpecdecError, ValueError):
    """The caller sent something malformed or out of range."""

    status = "INVALID_ARGUMENT"


class UnknownRequest(SpecdecError, KeyError):
    """A request id the service does not hold."""

    status = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class DuplicateRequest(SpecdecError):
    """A request id that is already running."""

    status = "ALREADY_EXISTS"


class OutOfPages(SpecdecError):
    """The KV pool cannot hold the request right now."""

    status = "RESOURCE_EXHAUSTED"


class NotReady(SpecdecError):
    """The service is still loading or is shutting down."""

    status = "UNAVAILABLE"


class OutOfOrder(SpecdecError):
    """A verify that names a request at another point than where the target holds it: the call continues from
    tokens the target has not committed yet (it overtook the call sent before it) or has moved past. Nothing was
    committed; the caller may send it again once the calls before it have landed."""

    status = "ABORTED"


class Cancelled(SpecdecError):
    """The caller left before the work ran (a draft's Prefill RPC for a request whose client cancelled during its
    admission): dropped."""

    status = "CANCELLED"


class ConfigError(SpecdecError):
    """A model directory, checkpoint or flag that cannot be used; raised at start-up."""

    status = "FAILED_PRECONDITION"
