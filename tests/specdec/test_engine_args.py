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


@pytest.mark.parametrize("fields, said", [
    ({"num_pages": -1}, r"^num_pages \(--num-pages\) -1: expected >= 0 \(0 = size from memory\)$"),
    ({"max_batch_size": 0}, r"^max_batch_size \(--max-batch-size\) 0: expected >= 1$"),
    ({"max_context": -5, "num_pages": -1}, r"^num_pages .*; max_context \(--max-context\) -5: expected >= 0 "),
])
def test_engine_options_name_each_count_out_of_range(fields, said):
    """Programmatic callers get the field (and its flag) that is wrong; it said all three "must be positive" while
    0 pages and 0 context are valid."""
    from specdec.engine.factory import EngineOptions

    EngineOptions(num_pages=0, max_context=0).validate()
    with pytest.raises(ConfigError, match=said):
        EngineOptions(**fields).validate()


def test_settings_that_would_refuse_requests_are_warned_of_at_start(caplog):
    """A --max-context over the model's positions is served at the model's (said, not silently), and a pool that
    cannot hold one request of the whole context starts with a WARNING naming --num-pages (QA: `--num-pages 1` started
    SERVING with a 16-token pool)."""
    import logging

    from repo_paths import TINY

    from specdec.engine.factory import EngineOptions, build_target

    with caplog.at_level(logging.WARNING, logger="specdec.engine.factory"):
        engine = build_target(str(TINY / "target"), EngineOptions(num_pages=1, max_context=10_000_000))
    assert engine.max_context == engine.cfg.max_position_embeddings
    assert f"--max-context 10000000 is more than the model's {engine.max_context} positions" in caplog.text
    assert "target KV pool (1 pages of 16 tokens) holds less than one request of the whole context" in caplog.text
