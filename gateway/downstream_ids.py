"""The request ids a gateway's streams run under on their pairs, so that two streams never share one.

A client's `request_id` (or `x-request-id`) names its request in logs and traces; it is not a uniqueness key.
Downstream, though, an id names the request's state on the draft and the target, and a second running request
under it is ALREADY_EXISTS there (after waiting up to 1 s for the first to be aborted: a cancel-and-retry). So a
stream takes the first id of `rid`, `rid~1`, `rid~2`, ... that no other stream of this gateway holds, and keeps
the ids it took until it ends (a failed attempt's id may still be held downstream while its abort travels).
Two gateways sending one client id to one pair at once still meet ALREADY_EXISTS (after the 1 s grace):
`FallbackGeneration` then takes a random suffix (`claim_unique`), which the other gateway does not take next.
"""

from __future__ import annotations

import secrets


def downstream_id(base: str, number: int) -> str:
    """The id of a stream's attempt `number`: the client's own first, then `base~number`."""
    return base if number == 0 else f"{base}~{number}"


class DownstreamIds:
    """Ids held by this gateway's streams (one event loop: no lock)."""

    def __init__(self) -> None:
        self._held: set[str] = set()

    def claim(self, base: str, number: int = 0) -> tuple[str, int]:
        """The first id from attempt `number` on that no stream holds, now held, and its number."""
        while downstream_id(base, number) in self._held:
            number += 1
        rid = downstream_id(base, number)
        self._held.add(rid)
        return rid, number

    def claim_unique(self, base: str) -> str:
        """`base~<random hex>`, now held: after a collision with another gateway's stream."""
        while (rid := f"{base}~{secrets.token_hex(4)}") in self._held:
            pass
        self._held.add(rid)
        return rid

    def release(self, rids) -> None:
        self._held.difference_update(rids)

    def __len__(self) -> int:
        return len(self._held)
