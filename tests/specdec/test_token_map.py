"""An EAGLE-1 head restricted to a token map (`--token-map`): it proposes only the map's tokens, its logits are the
full head's at those tokens, speculation stays lossless, and bad maps fail at start with the flag named."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from core_checkpoints import make_eagle, make_llama_target
from core_engines import OPTS, tiny_draft, tiny_target
from repo_paths import TINY

from specdec.cli import main as cli_main
from specdec.engine.draft_engine import SpecConfig
from specdec.engine.factory import build_draft
from specdec.engine.generate import generate
from specdec.errors import ConfigError
from specdec.models.loader import load_draft
from specdec.models.token_map import eagle3_draft_vocab, read_token_map, write_token_map
from specdec.sampling_params import SamplingParams

VOCAB = 8192  # the tiny pair's


@pytest.fixture(scope="module")
def map_file(tmp_path_factory):
    """The tiny EAGLE-3 head's draft vocabulary (the 4096 most frequent tokens of the pair's training data)."""
    path = tmp_path_factory.mktemp("map") / "map.json"
    write_token_map(eagle3_draft_vocab(TINY / "draft-eagle3"), path)
    return path


def test_a_restricted_head_has_the_full_heads_logits_at_the_maps_tokens(tmp_path):
    target = make_llama_target(tmp_path / "t", vocab=96)
    cfg = json.loads((target / "config.json").read_text())
    head = make_eagle(tmp_path / "d", cfg, "eagle1")
    full = load_draft(head, target, torch.float32)
    small = load_draft(head, target, torch.float32)
    ids = [95, 3, 40, 7, 0, 61]
    small.restrict_vocab(ids)
    hidden = torch.randn(5, cfg["hidden_size"])
    # (equal up to rounding: a BLAS may take another kernel for a 6-row weight than for a 96-row one; this machine's
    # differed in the last bit)
    torch.testing.assert_close(small.compute_logits(hidden), full.compute_logits(hidden)[:, ids], rtol=1e-6, atol=1e-6)
    assert small.to_target_ids(torch.arange(len(ids))).tolist() == ids
    assert small.cfg.draft_vocab_size == len(ids) and full.lm_head.weight.shape[0] == 96  # the original left whole
    eagle3 = load_draft(make_eagle(tmp_path / "e3", cfg, "eagle3", draft_vocab=32), target, torch.float32)
    with pytest.raises(ConfigError, match="EAGLE-1"):
        eagle3.restrict_vocab(ids)


def test_speculation_with_a_token_map_is_lossless_and_proposes_only_its_tokens(map_file, dev_prompts,
                                                                                tiny_tokenizer):
    allowed = set(read_token_map(map_file, VOCAB))
    target = tiny_target()
    draft = build_draft(str(TINY / "draft"), str(TINY / "target"), SpecConfig(4, 2, 6), replace(OPTS, token_map=str(
        map_file)), target.max_context)
    assert draft.model.cfg.draft_vocab_size == len(allowed) == 4096
    proposed = []
    propose = draft.propose

    def spy(*args, **kwargs):
        trees = propose(*args, **kwargs)
        proposed.extend(tok for tree in trees for tok in tree.tokens)
        return trees

    draft.propose = spy
    prompts = [tiny_tokenizer.encode(p)[-128:] for p in dev_prompts[:6]]
    params = SamplingParams(max_new_tokens=32)
    spec = generate(target, draft, prompts, params, max_batch_size=6)
    plain = generate(target, None, prompts, params, max_batch_size=6)
    assert [r.tokens for r in spec] == [r.tokens for r in plain]
    assert proposed and set(proposed) <= allowed
    steps = sum(r.num_verify_steps for r in spec)
    assert sum(len(r.tokens) - 1 for r in spec) / steps > 2.0  # speculation still accepts (tau 3.3 on 30 prompts)
    full = tiny_draft("draft")
    assert full.model.cfg.draft_vocab_size == VOCAB  # the cached engines are not touched


@pytest.mark.parametrize("content, message", [
    ("not json", "not JSON"),
    ("[]", "non-empty JSON list"),
    ('{"ids": [1]}', "non-empty JSON list"),
    ("[1, true]", "non-empty JSON list"),
    ("[1, 8192]", r"\[8192\] outside the target's vocabulary \[0, 8192\)"),
    ("[-1, 2]", r"\[-1\] outside"),
    ("[5, 3, 5]", r"listed more than once: \[5\]"),
])
def test_a_bad_token_map_is_refused_naming_the_flag(tmp_path, content, message):
    path = tmp_path / "map.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as err:
        read_token_map(path, VOCAB)
    assert "--token-map" in str(err.value)
    with pytest.raises(ConfigError, match="cannot read"):
        read_token_map(tmp_path / "missing.json", VOCAB)
    assert read_token_map(_written(tmp_path, {"token_ids": [4, 2]}), VOCAB) == [4, 2]


def test_a_tree_the_drafts_vocabulary_or_context_cannot_hold_is_refused_at_start(tmp_path):
    """A topk over the token map's size, a num_steps of the context length: one ConfigError naming the flag (QA: the
    first failed start-up with torch.topk's traceback, or, with calibration off, every request; the second started
    and never speculated)."""
    small = _written(tmp_path, {"token_ids": list(range(8))})
    with pytest.raises(ConfigError, match=r"--topk 10 exceeds the draft vocabulary \(8 tokens, --token-map"):
        build_draft(str(TINY / "draft"), str(TINY / "target"), SpecConfig(2, 10, 12),
                    replace(OPTS, token_map=str(small)), 512)
    with pytest.raises(ConfigError, match=r"--num-steps 512 must be below the context length \(512\)"):
        build_draft(str(TINY / "draft"), str(TINY / "target"), SpecConfig(512, 1, 5), OPTS, 512)
    assert build_draft(str(TINY / "draft"), str(TINY / "target"), SpecConfig(2, 8, 12),
                       replace(OPTS, token_map=str(small)), 512).spec.topk == 8


def _written(tmp_path, obj):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(obj))
    return path


def test_token_map_command_from_a_corpus_and_from_an_eagle3_head(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("def f(x):\n    return x + x\n" * 20)
    (corpus / "b.txt").write_text("import os\nprint(os.getcwd())\n")
    (corpus / "skip.bin").write_text("zzzzzzzz" * 100)
    out = tmp_path / "map.json"
    assert cli_main(["token-map", "--corpus", str(corpus), "--tokenizer", str(TINY / "target"), "--size", "5",
                     "--out", str(out)]) == 0
    ids = read_token_map(out, VOCAB)
    assert len(ids) == 5 and json.loads(out.read_text()) == {"token_ids": ids}  # the form the docs name first
    assert read_token_map(_written(tmp_path, ids), VOCAB) == ids  # a bare list is read alike
    from specdec.tokenizer import load_tokenizer

    counts = {}
    for text in ("def f(x):\n    return x + x\n" * 20, "import os\nprint(os.getcwd())\n"):
        for tok in load_tokenizer(str(TINY / "target")).encode_ordinary(text):
            counts[tok] = counts.get(tok, 0) + 1
    assert ids == sorted(counts, key=lambda t: (-counts[t], t))[:5]  # the most frequent, most frequent first
    assert "cover" in capsys.readouterr().err
    assert cli_main(["token-map", "--from-eagle3", str(TINY / "draft-eagle3"), "--out", str(out)]) == 0
    assert read_token_map(out, VOCAB) == eagle3_draft_vocab(TINY / "draft-eagle3")
    assert cli_main(["token-map", "--corpus", str(corpus), "--out", str(out)]) == 2  # no tokenizer
    empty = tmp_path / "empty.txt"
    empty.write_text("")  # an empty map was written before, and refused by every reader (QA)
    assert cli_main(["token-map", "--corpus", str(empty), "--tokenizer", str(TINY / "target"), "--out",
                     str(out)]) == 2
    assert cli_main(["token-map", "--from-eagle3", str(TINY / "draft-eagle3"), "--out", str(tmp_path)]) == 2
    assert cli_main(["token-map", "--from-eagle3", str(TINY / "draft"), "--out", str(out)]) == 2  # an EAGLE-1 head
    assert "no d2t" in capsys.readouterr().err


def test_serve_draft_takes_the_flag(map_file):
    from argparse import ArgumentParser

    from specdec.serving.engine_args import engine_options

    parser = ArgumentParser()
    sub = parser.add_subparsers()
    import draft_service.cli

    draft_service.cli.register(sub)
    args = parser.parse_args(["serve-draft", "--model", str(TINY / "draft"), "--target-model", str(TINY / "target"),
                              "--target", "127.0.0.1:1", "--token-map", str(map_file)])
    assert engine_options(args).token_map == str(map_file)
