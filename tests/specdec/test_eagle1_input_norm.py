"""EAGLE-1 exports that carry `layers.0.input_layernorm.weight`, which the reference EAGLE-1 layer does not have
(its training code makes no input norm for layer 0). Before, such a head failed to load ("unexpected tensor").
Now a weight of all ones (made and never trained: never in the forward) is ignored, and one with trained values is
applied before the layer's attention, as a Llama layer does. Checked on a one-token forward, whose attention is its
own value, against the layer computed by hand."""

from __future__ import annotations

import json

import pytest
import torch
from core_checkpoints import make_eagle, make_llama_target
from safetensors.torch import load_file, save_file

from specdec.attention import AttentionBatch, SeqAttention, make_backend
from specdec.kv_cache import PagedKVCache
from specdec.models.loader import EAGLE1_INPUT_NORM, load_draft

NORM = EAGLE1_INPUT_NORM


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_llama_target(tmp_path_factory.mktemp("t"), shard=False)


def _head(target, tmp_path, norm: torch.Tensor | None):
    cfg = json.loads((target / "config.json").read_text())
    head = make_eagle(tmp_path / "eagle1", cfg, "eagle1")
    tensors = load_file(str(head / "model.safetensors"))
    if norm is not None:
        tensors[NORM] = norm
    save_file(tensors, str(head / "model.safetensors"))
    return load_draft(head, target, torch.float32), tensors


def _one_token(draft, token: int, feature: torch.Tensor) -> torch.Tensor:
    cfg = draft.cfg
    kv = PagedKVCache(1, cfg.num_kv_heads, cfg.head_dim, 4, 16, torch.float32, "cpu")
    kv.add("r", 16)
    kv.resize("r", 1)
    backend = make_backend("torch", kv, cfg.num_heads)
    slots = kv.slots("r", 0, 1)
    batch = backend.plan(AttentionBatch([SeqAttention(slots, 1)], slots))
    with torch.inference_mode():
        return draft(torch.tensor([token]), feature[None], torch.tensor([0]), backend, batch)[0]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _by_hand(t: dict, embed: torch.Tensor, feature: torch.Tensor, norm, eps: float, kv_heads: int,
             groups: int) -> torch.Tensor:
    x = t["fc.weight"] @ torch.cat([embed, feature]) + t["fc.bias"]
    attn_in = x if norm is None else _rms(x, norm, eps)
    v = (t["layers.0.self_attn.v_proj.weight"] @ attn_in).view(kv_heads, -1)  # one token: attention is its value
    x = x + t["layers.0.self_attn.o_proj.weight"] @ v.repeat_interleave(groups, dim=0).reshape(-1)
    n = _rms(x, t["layers.0.post_attention_layernorm.weight"], eps)
    gate, up = t["layers.0.mlp.gate_proj.weight"] @ n, t["layers.0.mlp.up_proj.weight"] @ n
    return x + t["layers.0.mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("kind", ["absent", "ones", "trained"])
def test_an_eagle1_input_norm_is_ignored_untrained_and_applied_trained(target, tmp_path, kind):
    h = json.loads((target / "config.json").read_text())["hidden_size"]
    norm = {"absent": None, "ones": torch.ones(h), "trained": 1 + 0.3 * torch.randn(h)}[kind]
    draft, t = _head(target, tmp_path, norm)
    assert draft.cfg.eagle1_input_norm == (kind == "trained")
    feature = torch.randn(h)
    got = _one_token(draft, 7, feature)
    embed = draft.embed_tokens.weight[7].detach()
    kv, groups = draft.cfg.num_kv_heads, draft.cfg.num_heads // draft.cfg.num_kv_heads
    want = _by_hand(t, embed, feature, norm if kind == "trained" else None, draft.cfg.rms_norm_eps, kv, groups)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if kind == "trained":  # and it matters: without the norm the result differs
        plain = _by_hand(t, embed, feature, None, draft.cfg.rms_norm_eps, kv, groups)
        assert not torch.allclose(got, plain, atol=1e-3)
