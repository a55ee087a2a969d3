"""A request's own tree shape (`SpecParams` on a Generate): the range check the gateway and the draft share.

Every field a request sets must be >= 1, whatever the request's route: the gateway checks it also for requests
it sends without speculation (`no_speculation`, or no draft up), so their validity does not depend on where they
run. The upper bounds, the draft service's own shape, only the draft knows (`DraftServicer._tree_cap`). Torch-free:
the gateway imports it.
"""

from __future__ import annotations

from specdec.errors import InvalidInput

TREE_CAP_FIELDS = ("num_steps", "topk", "num_draft_tokens")  # `specdec.tree.TreeCap`'s fields, in its order


def asked_tree_shape(spec) -> dict[str, int]:
    """The fields `spec` (a `common_pb2.SpecParams`) sets, each checked to be >= 1 (InvalidInput)."""
    asked = {f: getattr(spec, f) for f in TREE_CAP_FIELDS if spec.HasField(f)}
    bad = {f: v for f, v in asked.items() if v < 1}
    if bad:
        raise InvalidInput(f"a request's spec may ask for num_steps, topk and num_draft_tokens from 1 up to the "
                           f"draft service's, not {bad}")
    return asked
