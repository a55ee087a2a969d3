"""sampling_codec: absent fields take defaults, present ones survive exactly, non-finite floats fail."""

from __future__ import annotations

import math

import pytest

from specdec.errors import InvalidInput
from specdec.rpc.sampling_codec import sampling_from_proto, sampling_to_proto
from specdec.sampling_params import SamplingParams
from specdec.v1 import common_pb2


def test_absent_fields_take_defaults():
    assert sampling_from_proto(common_pb2.SamplingParams()) == SamplingParams()
    assert sampling_from_proto(None) == SamplingParams()
    assert sampling_from_proto(common_pb2.SamplingParams(), default_max_new_tokens=16).max_new_tokens == 16


def test_present_defaults_are_kept_as_sent():
    # Explicit top_p=1 / temperature=0 equal the defaults; a sent max_new_tokens beats the service default.
    msg = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=5, seed=0)
    params = sampling_from_proto(msg, default_max_new_tokens=64)
    assert params == SamplingParams(max_new_tokens=5, seed=0)
    assert params.seed == 0  # present zero seed is not "no seed"


def test_round_trip_is_exact():
    params = SamplingParams(
        temperature=0.7, top_k=40, top_p=0.95, min_p=0.05, seed=2**63 - 1,
        max_new_tokens=300, stop_token_ids=(5, 9), ignore_eos=True,
    )  # fmt: skip
    msg = sampling_to_proto(params)
    assert sampling_from_proto(common_pb2.SamplingParams.FromString(msg.SerializeToString())) == params


def test_to_proto_sets_presence_except_for_absent_seed():
    msg = sampling_to_proto(SamplingParams())
    assert msg.HasField("temperature") and msg.HasField("max_new_tokens") and msg.HasField("ignore_eos")
    assert not msg.HasField("seed")


def test_ranges_are_left_to_validate():
    params = sampling_from_proto(common_pb2.SamplingParams(top_p=7.0, top_k=-3))
    with pytest.raises(InvalidInput, match="top_k"):
        params.validate()


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused(field, value):
    with pytest.raises(InvalidInput, match=field):
        sampling_from_proto(common_pb2.SamplingParams(**{field: value}))
