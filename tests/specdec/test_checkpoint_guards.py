"""Checkpoints the model code cannot compute exactly are refused by name, and broken files name themselves.

QA found checkpoints that loaded and computed wrong logits without a word (a gelu MLP, a Mistral sliding window,
a stray `*.safetensors` beside `model.safetensors`), and broken files that ended start-up with a library's
traceback naming no file. Each case here is a tiny checkpoint written on the fly.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from core_checkpoints import make_eagle, make_llama_target
from safetensors.torch import load_file, save_file

from specdec.config import ModelConfig
from specdec.errors import ConfigError
from specdec.models.loader import load_draft, load_target


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return make_llama_target(tmp_path_factory.mktemp("single"), shard=False)


@pytest.mark.parametrize(("changes", "message"), [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"rope_scaling": {"rope_type": "llama3"}}, 'llama3 needs a "factor"'),
    ({"rope_scaling": "llama3"}, "rope_scaling must be an object"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "eight"}}, "not a number"),
    ({"hidden_size": "big"}, "not a whole number"),
    # each field named, not a traceback (QA: ValueError, ZeroDivisionError, a torch RuntimeError, a context of 0)
    ({"num_key_value_heads": "two"}, "a size field is not a whole number"),
    ({"head_dim": "48?"}, "a size field is not a whole number"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps 'tiny' is not a number"),
    ({"max_position_embeddings": "512k"}, "max_position_embeddings '512k' is not a whole number"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive whole number, not 0"),
    ({"num_key_value_heads": -2}, "num_key_value_heads must be a positive whole number, not -2"),
    ({"max_position_embeddings": -5}, "max_position_embeddings must be a positive whole number, not -5"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a positive whole number, not 0"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": "wide"}, "sliding_window 'wide' is not a whole"),
])
def test_configs_the_model_code_does_not_compute_are_refused_by_name(tmp_path, changes, message):
    raw = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "vocab_size": 96, "intermediate_size": 128, "hidden_act": "silu", **changes}
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(raw, "m")
    with pytest.raises(ConfigError, match="not a JSON object"):
        ModelConfig.from_dict([raw], "m")


def test_absent_context_fields_take_transformers_defaults():
    """Llama without `max_position_embeddings`: 2048 (was 4096); Mistral without it: 131072, and without a
    `sliding_window` key transformers' window of 4096 (was full attention: other tokens than transformers' past
    4096, QA); a null window is none. A llama3 scaling without a pre-training context takes the default too."""
    from transformers import LlamaConfig, MistralConfig

    base = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 96,
            "intermediate_size": 128}
    llama = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **base}, "m")
    assert llama.max_position_embeddings == LlamaConfig(**base).max_position_embeddings == 2048
    mistral = ModelConfig.from_dict({"architectures": ["MistralForCausalLM"], **base}, "m-default")
    assert mistral.max_position_embeddings == MistralConfig(**base).sliding_window == 4096
    unwindowed = ModelConfig.from_dict({"architectures": ["MistralForCausalLM"], **base, "sliding_window": None}, "m")
    assert unwindowed.max_position_embeddings == MistralConfig(**base).max_position_embeddings == 131072
    scaled = ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"], **base,
                                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "m")
    assert scaled.rope_scaling.original_max_position_embeddings == 2048


def test_a_mistral_sliding_window_caps_the_context(caplog):
    """Attention over a window is not implemented; within the window it is full attention, so the context is the
    window (a sliding window of 16 gave wrong logits from token 17 on before, QA)."""
    raw = {"architectures": ["MistralForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "vocab_size": 96, "intermediate_size": 128, "max_position_embeddings": 32768}
    with caplog.at_level(logging.WARNING, logger="specdec.config"):
        for _ in range(3):  # said once a checkpoint (a draft reads its target's config several times)
            assert ModelConfig.from_dict({**raw, "sliding_window": 4096}, "windowed").max_position_embeddings == 4096
    assert caplog.text.count("context is capped at 4096") == 1
    assert ModelConfig.from_dict({**raw, "sliding_window": None}, "m").max_position_embeddings == 32768
    assert ModelConfig.from_dict({**raw, "sliding_window": 65536}, "m").max_position_embeddings == 32768


def test_a_stray_safetensors_file_beside_model_safetensors_is_not_read(single, tmp_path, caplog):
    """As transformers: without an index, `model.safetensors` alone is the checkpoint (a backup file sorting after
    it replaced its tensors before, QA); files of other names holding one tensor twice are refused."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(single, ckpt)
    reference = load_target(ckpt, torch.float32)
    tensors = load_file(str(ckpt / "model.safetensors"))
    save_file({k: torch.randn_like(v) for k, v in tensors.items()}, str(ckpt / "model_old_backup.safetensors"))
    with caplog.at_level(logging.WARNING, logger="specdec.weights"):
        loaded = load_target(ckpt, torch.float32)
    assert "not read: model_old_backup.safetensors" in caplog.text
    assert torch.equal(loaded.lm_head.weight, reference.lm_head.weight)
    (ckpt / "model.safetensors").rename(ckpt / "a.safetensors")
    with pytest.raises(ConfigError, match="is in both a.safetensors and model_old_backup.safetensors"):
        load_target(ckpt, torch.float32)


@pytest.mark.parametrize("damage", ["truncated", "empty", "index not json", "index without a map", "wrong shard"])
def test_broken_files_are_named_in_one_error(tmp_path, damage):
    ckpt = make_llama_target(tmp_path / "ckpt", shard=True)
    index = ckpt / "model.safetensors.index.json"
    shard = sorted(ckpt.glob("model-*.safetensors"))[-1]
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        expected = f"{shard.name}: not a readable safetensors file"
    elif damage == "empty":
        shard.write_bytes(b"")
        expected = f"{shard.name}: not a readable safetensors file"
    elif damage == "index not json":
        index.write_text("{not json")
        expected = "index.json: not valid JSON"
    elif damage == "index without a map":
        index.write_text(json.dumps({"metadata": {}}))
        expected = 'no "weight_map" object'
    else:
        raw = json.loads(index.read_text())
        name = next(n for n, f in raw["weight_map"].items() if f != shard.name)
        raw["weight_map"][name] = shard.name
        index.write_text(json.dumps(raw))
        expected = f"{shard.name}: has no tensor '{name}', which model.safetensors.index.json says it holds"
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.").replace("(", r"\(")):
        load_target(ckpt, torch.float32)


def test_old_rope_tables_in_a_checkpoint_are_not_read(single, tmp_path):
    """Llama-2 conversions carry `rotary_emb.inv_freq` buffers; the tables are computed, so they are skipped (they
    were an 'unexpected tensor' before)."""
    import shutil

    ckpt = tmp_path / "ckpt"
    shutil.copytree(single, ckpt)
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, str(ckpt / "model.safetensors"))
    loaded, reference = load_target(ckpt, torch.float32), load_target(single, torch.float32)
    assert torch.equal(loaded.lm_head.weight, reference.lm_head.weight)


def test_an_eagle3_head_over_the_whole_vocabulary_may_ship_no_map(single, tmp_path):
    """Without `d2t`/`t2d` and with the target's vocabulary, draft ids are target ids (was "tensor 'd2t' not
    found"); a reduced vocabulary still needs its map."""
    cfg = json.loads((single / "config.json").read_text())
    head = make_eagle(tmp_path / "eagle3", cfg, "eagle3")
    tensors = load_file(str(head / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}, str(head / "model.safetensors"))
    draft = load_draft(head, single, torch.float32)
    assert torch.equal(draft.to_target_ids(torch.arange(5)), torch.arange(5))
    reduced = make_eagle(tmp_path / "reduced", cfg, "eagle3", draft_vocab=48)
    tensors = load_file(str(reduced / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}, str(reduced / "model.safetensors"))
    with pytest.raises(ConfigError, match="'d2t' not found"):
        load_draft(reduced, single, torch.float32)


@pytest.mark.parametrize(("shift", "message"), [(1000, "d2t maps draft id 0 to 1000, outside"),
                                                 (-100, "d2t maps draft id 0 to -100, outside")])
def test_an_eagle3_map_to_ids_outside_the_target_vocabulary_is_refused_at_load(single, tmp_path, shift, message):
    """A head whose d2t names target ids the target does not have started, and then every request failed at its
    first draft step (IndexError in the embedding on a CPU; a device assert on a GPU: QA)."""
    cfg = json.loads((single / "config.json").read_text())
    head = make_eagle(tmp_path / "eagle3", cfg, "eagle3", draft_vocab=48)
    tensors = load_file(str(head / "model.safetensors"))
    tensors["d2t"][0] = shift
    save_file(tensors, str(head / "model.safetensors"))
    with pytest.raises(ConfigError, match=f"{message} the target's vocabulary \\[0, 96\\)"):
        load_draft(head, single, torch.float32)
