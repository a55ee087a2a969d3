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


def test_plain_steps_default_per_service_and_bounds():
    from draft_service.cli import DRAFT_PLAIN_STEPS

    assert plain_steps(_parse()) == 4  # the target's Generate
    assert plain_steps(_parse(plain_steps=DRAFT_PLAIN_STEPS)) == 16
    assert plain_steps(_parse("--plain-steps", "1")) == 1
    for bad in ("0", "65"):
        with pytest.raises(ConfigError, match="--plain-steps"):
            plain_steps(_parse("--plain-steps", bad))
