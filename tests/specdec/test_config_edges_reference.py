"""Configs and checkpoints whose fields disagree are read as transformers 5 reads them: the logits equal
transformers' (fp32). Before, each of these loaded without an error and gave other logits (QA)."""

from __future__ import annotations

import json

import pytest
import torch
from core_checkpoints import make_eagle, make_llama_target
from safetensors.torch import load_file, save_file

from specdec.attention import AttentionBatch, SeqAttention, make_backend
from specdec.errors import ConfigError
from specdec.kv_cache import PagedKVCache
from specdec.models.loader import load_draft, load_target

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _edit_config(path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def _logits(model, ids: list[int]) -> torch.Tensor:
    c = model.cfg
    kv = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 32, 8, torch.float32, "cpu")
    backend = make_backend("torch", kv, c.num_heads)
    kv.add("r")
    kv.resize("r", len(ids))
    slots = kv.slots("r", 0, len(ids))
    with torch.no_grad():
        out = model(torch.tensor(ids), torch.arange(len(ids)), backend,
                    AttentionBatch([SeqAttention(slots, len(ids))], slots))
        return model.compute_logits(out.hidden)


def _matches_transformers(path, n: int = 120) -> None:
    from transformers import LlamaForCausalLM as HFLlama

    hf = HFLlama.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    ours = _logits(load_target(path, torch.float32), ids)
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4
    assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_a_theta_in_rope_parameters_wins_over_the_top_level_one(tmp_path):
    make_llama_target(tmp_path, shard=False)
    _edit_config(tmp_path, rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    _matches_transformers(tmp_path)


def test_a_legacy_rope_scaling_wins_over_rope_parameters(tmp_path):
    make_llama_target(tmp_path, shard=False)
    _edit_config(tmp_path, rope_theta=None, rope_scaling={"rope_type": "default"},
                 rope_parameters={**LLAMA3, "rope_theta": 500.0, "original_max_position_embeddings": 32})
    _matches_transformers(tmp_path)


def test_llama3_scaling_without_its_context_takes_max_position_embeddings(tmp_path):
    make_llama_target(tmp_path, shard=False)
    _edit_config(tmp_path, rope_scaling=None, max_position_embeddings=64,
                 rope_parameters={**LLAMA3, "rope_theta": 10000.0})
    _matches_transformers(tmp_path, n=60)


def test_a_tied_config_with_a_stored_lm_head_of_other_values_uses_it(tmp_path, caplog):
    make_llama_target(tmp_path, tie=False, shard=False)
    _edit_config(tmp_path, tie_word_embeddings=True)
    _matches_transformers(tmp_path)
    assert "stores an lm_head of other values: that one is used" in caplog.text


def test_a_tied_config_with_a_stored_copy_of_the_embeddings_stays_tied(tmp_path):
    make_llama_target(tmp_path, tie=False, shard=False)
    _edit_config(tmp_path, tie_word_embeddings=True)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    _matches_transformers(tmp_path)
    model = load_target(tmp_path, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_an_eagle1_head_without_an_lm_head_shares_the_one_its_target_uses(tmp_path):
    target = make_llama_target(tmp_path / "t", tie=False, shard=False)
    _edit_config(target, tie_word_embeddings=True)  # the stored lm_head differs: the target uses it
    cfg = json.loads((target / "config.json").read_text())
    draft = make_eagle(tmp_path / "d", cfg, "eagle1")
    tensors = load_file(draft / "model.safetensors")
    tensors.pop("lm_head.weight", None)
    save_file(tensors, draft / "model.safetensors", metadata={"format": "pt"})
    head = load_draft(draft, target, torch.float32).lm_head.weight
    assert torch.equal(head, load_target(target, torch.float32).lm_head.weight)


def _reads(monkeypatch) -> list[str]:
    """The tensor names the loader reads from checkpoints, in order (one entry per read)."""
    import specdec.models.loader as loader

    names, real = [], loader.load_tensors

    def counting(path, wanted=None, *args, **kwargs):
        out = real(path, wanted, *args, **kwargs)
        names.extend(f"{path.name}/{n}" for n in out)
        return out

    monkeypatch.setattr(loader, "load_tensors", counting)
    return names


def test_the_tie_check_reads_each_target_tensor_once(tmp_path, monkeypatch):
    """The tie check's two tensors are used, not read again (before: twice for the target, three times more for
    an EAGLE-1 head that shares the target's lm_head)."""
    target = make_llama_target(tmp_path / "t", tie=False, shard=False)
    _edit_config(target, tie_word_embeddings=True)
    draft = make_eagle(tmp_path / "d", json.loads((target / "config.json").read_text()), "eagle1")
    tensors = load_file(draft / "model.safetensors")
    for name in ("lm_head.weight", "embed_tokens.weight"):
        tensors.pop(name, None)
    save_file(tensors, draft / "model.safetensors", metadata={"format": "pt"})
    reads = _reads(monkeypatch)
    model = load_target(target, torch.float32)
    assert len(reads) == len(set(reads)) and "t/lm_head.weight" in reads
    reads.clear()
    head = load_draft(draft, target, torch.float32)
    assert sorted(r for r in reads if r.startswith("t/")) == ["t/lm_head.weight", "t/model.embed_tokens.weight"]
    assert len(reads) == len(set(reads))
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)
    assert torch.equal(head.embed_tokens.weight, model.model.embed_tokens.weight)


def test_an_eagle3_heads_default_layers_past_a_small_target_are_refused_at_load(tmp_path):
    target = make_llama_target(tmp_path / "t", layers=2, shard=False)
    cfg = json.loads((target / "config.json").read_text())
    draft = make_eagle(tmp_path / "d", cfg, "eagle3")
    dcfg = json.loads((draft / "config.json").read_text())
    dcfg.pop("eagle_config", None)
    dcfg.pop("target_num_hidden_layers", None)
    (draft / "config.json").write_text(json.dumps(dcfg))
    with pytest.raises(ConfigError, match="has 2 layers: the head was trained for another target"):
        load_draft(draft, target, torch.float32)


def test_the_targets_end_ids_are_generation_configs_as_the_gateways_are(tmp_path):
    """transformers' `generate` stops at generation_config.json's `eos_token_id` (Llama-3-Instruct lists its
    end-of-turn id there only); the target engine read config.json's alone and ran past it on
    `TargetService.Generate`, while the gateway, which reads generation_config.json, stopped (QA)."""
    from specdec.engine.target_engine import TargetEngine
    from specdec.tokenizer.tokenizer_config import TokenizerConfig

    make_llama_target(tmp_path, shard=False)  # config.json: eos_token_id 2
    assert TargetEngine(load_target(tmp_path, torch.float32), num_pages=8).eos_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert TargetEngine(load_target(tmp_path, torch.float32), num_pages=8).eos_ids == (2, 7)
    assert TokenizerConfig.from_dir(tmp_path).eos_token_ids == (2, 7)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "end"}))
    with pytest.raises(ConfigError, match="eos_token_id 'end' is not a token id"):
        load_target(tmp_path, torch.float32)
