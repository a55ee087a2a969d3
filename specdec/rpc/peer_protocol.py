"""A peer that answers a connection, but not in gRPC's HTTP/2: the address of another kind of server (an HTTP/1
server, a service's `--metrics-port`). gRPC reports it as UNAVAILABLE "Failed parsing HTTP/2 (Expected SETTINGS
frame ...)", as it would a peer still starting, and keeps reconnecting: a client waiting for its peer waited its
whole patience for nothing and then printed gRPC's text alone (QA: `--target` at an HTTP port failed only after
`--target-wait-seconds`). Used by the draft's target client and by the gateway's health checks and CLI."""

from __future__ import annotations

import grpc

NOT_HTTP2 = "Failed parsing HTTP/2"  # gRPC core's words for a first frame that is not HTTP/2's


def not_grpc(code: grpc.StatusCode | None, details: str | None) -> bool:
    """Whether a failed call's status says its peer answered in another protocol than gRPC's."""
    return code == grpc.StatusCode.UNAVAILABLE and NOT_HTTP2 in (details or "")


def not_grpc_text(peer: str) -> str:
    """What to tell the user of such a peer (`peer`: how it is named, e.g. "the target at HOST:PORT")."""
    return (f"{peer} answered, but not in gRPC's HTTP/2: it is another kind of server (an HTTP/1 server, a "
            "service's --metrics-port?), not a specdec service's gRPC port")
