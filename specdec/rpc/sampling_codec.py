"""`specdec.v1.SamplingParams` <-> `specdec.sampling_params.SamplingParams`.

Absent (unset) fields take the dataclass defaults; present fields are kept as sent, even when equal to the
default. Ranges are not checked here (the engine calls `SamplingParams.validate()`), only non-finite floats,
which no range check should ever see.
"""

from __future__ import annotations

import math

from specdec.errors import InvalidInput
from specdec.sampling_params import SamplingParams
from specdec.v1 import common_pb2

_DEFAULTS = SamplingParams()
_FLOAT_FIELDS = ("temperature", "top_p", "min_p")


def sampling_from_proto(
    msg: common_pb2.SamplingParams | None, default_max_new_tokens: int = _DEFAULTS.max_new_tokens
) -> SamplingParams:
    """Build SamplingParams from a message (None or an unset sub-message means all defaults)."""
    if msg is None:
        return SamplingParams(max_new_tokens=default_max_new_tokens)
    for name in _FLOAT_FIELDS:
        if msg.HasField(name) and not math.isfinite(getattr(msg, name)):
            raise InvalidInput(f"{name} must be a finite number, got {getattr(msg, name)}")

    def pick(name: str, default):
        return getattr(msg, name) if msg.HasField(name) else default

    return SamplingParams(
        temperature=pick("temperature", _DEFAULTS.temperature),
        top_k=pick("top_k", _DEFAULTS.top_k),
        top_p=pick("top_p", _DEFAULTS.top_p),
        min_p=pick("min_p", _DEFAULTS.min_p),
        seed=pick("seed", None),
        max_new_tokens=pick("max_new_tokens", default_max_new_tokens),
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=pick("ignore_eos", _DEFAULTS.ignore_eos),
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """Encode every field explicitly (seed only when set), so the receiver needs no defaults of its own."""
    msg = common_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        max_new_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    return msg
