"""A request's own tree shape (`SpecParams` on a Generate): the range check the gateway and the draft share.

Every field a request sets must be >= 1, whatever the request's route: the gateway checks it also for requests
it sends without speculation (`no_speculation`, or no draft up), so their validity does not depend on where they
run. The upper bounds are a draft service's own shape (`DraftServicer._tree_cap`); the gateway checks them too,
against the shapes its drafts reported (`GetModelInfo.spec`; `check_fits`), so a request too big for them is
refused the same way whether a draft is up or the request falls back to its target. Torch-free: the gateway
imports it.
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


def fits(asked: dict[str, int], shape: dict[str, int] | None) -> bool:
    """Does a request's spec (`asked_tree_shape`) fit a draft's shape (None: not known, taken as fitting)?"""
    return shape is None or all(v <= shape[f] for f, v in asked.items())


def check_fits(asked: dict[str, int], shapes: list[dict[str, int]], who: str) -> None:
    """InvalidInput unless `asked` (`asked_tree_shape`) fits one of `shapes` whole (num_steps, topk and
    num_draft_tokens of `who`: a draft service, or the drafts a gateway knows; none known: nothing to check). With
    pairs of different shapes a tree's topk and a chain's depth fit neither."""
    if not shapes or any(fits(asked, shape) for shape in shapes):
        return
    if len(shapes) == 1:
        shape = shapes[0]
        bad = {f: v for f, v in asked.items() if v > shape[f]}
        runs = " ".join(f"{f}={shape[f]}" for f in TREE_CAP_FIELDS)
        raise InvalidInput(f"{who} runs {runs}; a request's spec may ask for each from 1 up to that, not {bad}")
    runs = "; ".join(" ".join(f"{f}={s[f]}" for f in TREE_CAP_FIELDS) for s in shapes)
    raise InvalidInput(f"no draft service runs a tree this spec fits ({runs}): a request's spec may ask for each "
                       f"field from 1 up to one draft's, not {asked}")
