"""Service flags shared by the model services: `--plain-steps` defaults per service and its bounds."""

from __future__ import annotations

import argparse

import pytest

from specdec.errors import ConfigError
from specdec.serving.engine_args import add_engine_args, plain_steps


def _parse(*argv, **defaults):
    p = argparse.ArgumentParser()
    add_engine_args(p, 1234, **defaults)
    return p.parse_args(list(argv))


def test_plain_steps_default_per_service_and_device_and_bounds():
    from draft_service.cli import DRAFT_GPU_PLAIN_STEPS

    assert plain_steps(_parse()) == 4 and plain_steps(_parse("--device", "cuda:1")) == 4  # the target's Generate
    draft = {"gpu_plain_steps": DRAFT_GPU_PLAIN_STEPS}
    assert plain_steps(_parse("--device", "cuda", **draft)) == 16  # each plain call pays a round trip
    assert plain_steps(_parse(**draft)) == 4  # on a CPU the forward dwarfs it
    assert plain_steps(_parse("--plain-steps", "1", "--device", "cuda", **draft)) == 1
    for bad in ("0", "65"):
        with pytest.raises(ConfigError, match="--plain-steps"):
            plain_steps(_parse("--plain-steps", bad))
