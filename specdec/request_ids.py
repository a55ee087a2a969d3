"""Request ids reserved for the services' own traffic, and the check that keeps clients' ids off them.

The draft's start-up warm-up (`specdec.engine.warmup`) sends its throw-away request under `WARMUP_PREFIX`, and
the target leaves such ids out of its metrics. A client choosing such an id could hide its traffic from them,
so every place a client names its request (the gateway's Generate, the services' Generate) refuses the prefix.
Torch-free: the gateway imports it.
"""

from __future__ import annotations

from specdec.errors import InvalidInput

WARMUP_PREFIX = "__warmup-"  # request ids of warm-up traffic: served like any other, left out of the metrics


def is_warmup(request_id: str) -> bool:
    return request_id.startswith(WARMUP_PREFIX)


def check_not_reserved(request_id: str) -> str:
    """`request_id` unchanged, or InvalidInput when a client's id poses as warm-up traffic."""
    if is_warmup(request_id):
        raise InvalidInput(f"request_id must not start with {WARMUP_PREFIX!r}: that prefix is reserved for the "
                           "services' own warm-up traffic")
    return request_id
