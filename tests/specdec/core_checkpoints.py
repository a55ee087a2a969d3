"""Tiny random checkpoints written on the fly: a transformers Llama target and EAGLE-1/EAGLE-3 heads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_llama_target(path: Path, *, vocab=96, hidden=64, layers=4, heads=4, kv_heads=2, tie=False,
                      rope_scaling=None, shard=True, dtype=torch.float32, seed=0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie, eos_token_id=2,
                      rope_scaling=rope_scaling)
    model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # larger weights than HF's init so differences would show
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path, max_shard_size="60KB" if shard else "1GB", safe_serialization=True)
    return path


def make_eagle(path: Path, target_cfg: dict, kind: str, *, draft_vocab=None, seed=1, with_bias=True) -> Path:
    g = torch.Generator().manual_seed(seed)
    h, v = target_cfg["hidden_size"], target_cfg["vocab_size"]
    heads, kv = target_cfg["num_attention_heads"], target_cfg["num_key_value_heads"]
    hd = h // heads
    inter = target_cfg["intermediate_size"]

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.08

    t: dict[str, torch.Tensor] = {}
    if kind == "eagle1":
        pre = "layers.0."
        t["fc.weight"] = rnd(h, 2 * h)
        if with_bias:
            t["fc.bias"] = rnd(h)
        attn_in = h
        arch = "LlamaForCausalLMEagle"
    else:
        pre = "midlayer."
        t["fc.weight"] = rnd(h, 3 * h)
        t[pre + "input_layernorm.weight"] = 1 + rnd(h)
        t[pre + "hidden_norm.weight"] = 1 + rnd(h)
        t["norm.weight"] = 1 + rnd(h)
        dv = draft_vocab or v
        t["lm_head.weight"] = rnd(dv, h)
        ids = torch.sort(torch.randperm(v, generator=g)[:dv]).values
        t["d2t"] = ids - torch.arange(dv)
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[ids] = True
        t["t2d"] = t2d
        attn_in = 2 * h
        arch = "LlamaForCausalLMEagle3"
    t[pre + "self_attn.q_proj.weight"] = rnd(heads * hd, attn_in)
    t[pre + "self_attn.k_proj.weight"] = rnd(kv * hd, attn_in)
    t[pre + "self_attn.v_proj.weight"] = rnd(kv * hd, attn_in)
    t[pre + "self_attn.o_proj.weight"] = rnd(h, heads * hd)
    t[pre + "post_attention_layernorm.weight"] = 1 + rnd(h)
    t[pre + "mlp.gate_proj.weight"] = rnd(inter, h)
    t[pre + "mlp.up_proj.weight"] = rnd(inter, h)
    t[pre + "mlp.down_proj.weight"] = rnd(h, inter)
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    cfg = {k: target_cfg[k] for k in ("hidden_size", "vocab_size", "num_attention_heads", "num_key_value_heads",
                                      "intermediate_size", "max_position_embeddings", "rms_norm_eps")}
    cfg.update(architectures=[arch], num_hidden_layers=1, head_dim=hd, rope_theta=10000.0, eos_token_id=2)
    if kind == "eagle3":
        cfg["draft_vocab_size"] = draft_vocab or v
    (path / "config.json").write_text(json.dumps(cfg))
    return path
