"""Linear, dynamic and yarn `rope_scaling`: the target's logits equal transformers' LlamaForCausalLM on the same
random checkpoint (fp32, rel. error < 1e-4) at positions past the pre-training context (32 here); bad fields are
refused by name. Before, the three types were refused at load."""

from __future__ import annotations

import json
import math

import pytest
import torch
from core_checkpoints import make_llama_target

from specdec.attention import AttentionBatch, SeqAttention, make_backend
from specdec.config import ModelConfig
from specdec.errors import ConfigError
from specdec.kv_cache import PagedKVCache
from specdec.models.layers import RotaryEmbedding
from specdec.models.loader import load_target

LINEAR = {"rope_type": "linear", "factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32}  # max_position_embeddings 256


def _target(path, rope_scaling: dict, **config_changes):
    make_llama_target(path, shard=False, rope_scaling=rope_scaling)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(config_changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(path, ids: list[int]) -> torch.Tensor:
    from transformers import LlamaForCausalLM as HFLlama

    hf = HFLlama.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


class _Paged:
    """One sequence through our target and a paged cache (pages of 8 tokens), prefilled then extended."""

    def __init__(self, model):
        c = model.cfg
        self.model, self.kv = model, PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, 40, 8, torch.float32,
                                                  "cpu")
        self.backend = make_backend("torch", self.kv, c.num_heads)
        self.kv.add("r")
        self.length = 0

    def extend(self, ids: list[int]) -> torch.Tensor:  # [len(ids), vocab]
        start, self.length = self.length, self.length + len(ids)
        self.kv.resize("r", self.length)
        ctx = self.kv.slots("r", 0, self.length)
        with torch.no_grad():
            out = self.model(torch.tensor(ids), torch.arange(start, self.length), self.backend,
                             AttentionBatch([SeqAttention(ctx, len(ids))], ctx[start:]))
            return self.model.compute_logits(out.hidden)


def _assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-4
    assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist()


@pytest.mark.parametrize("scaling", [
    LINEAR,
    {"type": "linear", "factor": 2.5},  # the legacy key
    YARN,
    {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {**YARN, "mscale": 0.9, "mscale_all_dim": 0.6},
    {**YARN, "attention_factor": 1.3},
    {**YARN, "factor": None},  # DeepSeek-V3 style: max_position_embeddings / the pre-training context, 8 here
], ids=["linear", "linear-legacy-key", "yarn", "yarn-betas-untruncated", "yarn-mscale", "yarn-attention-factor",
        "yarn-null-factor"])
def test_prefill_logits_match_transformers_past_the_pretraining_context(tmp_path, scaling):
    path = _target(tmp_path, scaling)
    ids = _ids(120)
    _assert_close(_Paged(load_target(path, torch.float32)).extend(ids), _hf_logits(path, ids))


def test_yarn_decode_token_by_token_through_the_paged_cache(tmp_path):
    """Prefill inside the pre-training context, then one token at a time past it, across page boundaries."""
    path = _target(tmp_path, YARN)
    ids = _ids(60, seed=1)
    ref = _hf_logits(path, ids)
    seq = _Paged(load_target(path, torch.float32))
    seq.extend(ids[:20])
    for pos in range(20, len(ids)):
        _assert_close(seq.extend([ids[pos]]), ref[pos:pos + 1])


def test_the_yarn_fields_resolve_as_transformers_defaults_them():
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "vocab_size": 96, "intermediate_size": 128, "max_position_embeddings": 128}
    scaling = ModelConfig.from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 4}}, "m").rope_scaling
    assert (scaling.rope_type, scaling.original_max_position_embeddings) == ("yarn", 128)
    assert (scaling.beta_fast, scaling.beta_slow, scaling.truncate) == (32.0, 1.0, True)
    assert scaling.attention_factor == pytest.approx(0.1 * math.log(4) + 1)
    raw = {**base, "rope_scaling": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 0, "truncate": None}}
    scaling = ModelConfig.from_dict(raw, "m").rope_scaling
    assert scaling.attention_factor == pytest.approx((0.1 * math.log(8) + 1) / (0.05 * math.log(8) + 1))
    assert (scaling.beta_fast, scaling.truncate) == (32.0, False)  # 0 and null read as transformers reads them


def test_dynamic_is_the_default_rope_within_max_position_embeddings(tmp_path):
    """transformers raises dynamic NTK's theta only once a sequence passes max_position_embeddings (48 here),
    the most positions specdec serves: over all of them the logits are transformers' and the tables the default
    rope's."""
    path = _target(tmp_path, {"rope_type": "dynamic", "factor": 4.0}, max_position_embeddings=48)
    model = load_target(path, torch.float32)
    ids = _ids(48, seed=2)
    _assert_close(_Paged(model).extend(ids), _hf_logits(path, ids))
    default = RotaryEmbedding(model.cfg.head_dim, 48, model.cfg.rope_theta, None)
    assert model.rope.cos.shape[0] == 48
    assert torch.equal(model.rope.cos, default.cos) and torch.equal(model.rope.sin, default.sin)


_RAW = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
        "vocab_size": 96, "intermediate_size": 128}


@pytest.mark.parametrize(("rope_scaling", "message"), [
    ({"rope_type": "linear"}, 'linear needs a "factor"'),
    ({"rope_type": "dynamic", "factor": None}, 'dynamic needs a "factor"'),
    ({"rope_type": "yarn", "original_max_position_embeddings": 32}, 'yarn needs a "factor"'),
    ({"rope_type": "linear", "factor": "two"}, "not a number \\(factor: 'two'\\)"),
    ({**YARN, "beta_fast": "fast"}, "not a number \\(beta_fast: 'fast'\\)"),
    ({**YARN, "original_max_position_embeddings": "long"}, "not a number \\(original_max_position_embeddings"),
    ({"rope_type": "linear", "factor": 0}, "factor must be > 0, not 0"),
    ({"rope_type": "dynamic", "factor": -2.0}, "factor must be > 0, not -2.0"),
    ({**YARN, "attention_factor": 0.0}, "attention_factor must be > 0"),
    ({**YARN, "truncate": "no"}, "truncate must be true or false, not 'no'"),
    ({"rope_type": "longrope", "factor": 4.0}, "'longrope' is not supported \\(supported: default, linear, dynamic"),
    ({**YARN, "original_max_position_embeddings": 0}, "original_max_position_embeddings must be > 0, not 0"),
    ({**YARN, "beta_slow": -1}, "beta_fast and beta_slow must be > 0, not 32.0 / -1.0"),
])
def test_bad_rope_scaling_fields_are_refused_by_name(rope_scaling, message):
    with pytest.raises(ConfigError, match=f"^m: rope_scaling.*{message}"):
        ModelConfig.from_dict({**_RAW, "rope_scaling": rope_scaling}, "m")
