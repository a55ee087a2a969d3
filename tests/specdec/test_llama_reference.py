"""Target logits equal transformers' LlamaForCausalLM on the same random checkpoint (fp32, rel. error < 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch
from core_checkpoints import make_llama_target

from specdec.attention import AttentionBatch, SeqAttention, make_backend
from specdec.kv_cache import PagedKVCache
from specdec.models.loader import load_target
from specdec.tree import ancestor_mask, depths

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module", params=["untied-gqa-llama3", "tied-mha"])
def pair(request, tmp_path_factory):
    from transformers import LlamaForCausalLM as HFLlama

    path = tmp_path_factory.mktemp(request.param)
    if request.param == "untied-gqa-llama3":
        make_llama_target(path, tie=False, kv_heads=2, rope_scaling=LLAMA3_SCALING)
    else:
        make_llama_target(path, tie=True, kv_heads=4, shard=False)
    hf = HFLlama.from_pretrained(path, torch_dtype=torch.float32).eval()
    ours = load_target(path, torch.float32)
    return hf, ours


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def _cache(model, page_size=4, pages=64):
    c = model.cfg
    kv = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, pages, page_size, torch.float32, "cpu")
    return kv, make_backend("torch", kv, c.num_heads)


def _run(model, backend, ids, positions, seqs, slots):
    with torch.no_grad():
        out = model(torch.tensor(ids), torch.tensor(positions), backend, AttentionBatch(seqs, slots))
        return model.compute_logits(out.hidden)


def test_sharded_checkpoint_is_sharded(pair, tmp_path):
    hf, ours = pair
    assert ours.cfg.num_layers == 4


def test_prefill_logits_match_transformers(pair):
    hf, ours = pair
    ids = torch.randint(3, 96, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    kv, backend = _cache(ours)
    kv.add("r")
    kv.resize("r", len(ids))
    slots = kv.slots("r", 0, len(ids))
    logits = _run(ours, backend, ids, list(range(len(ids))), [SeqAttention(slots, len(ids))], slots)
    assert _rel_err(logits, _hf_logits(hf, ids)) < 1e-4


def test_incremental_decode_through_paged_cache(pair):
    """Prefill 10 tokens, then decode one token at a time across page boundaries (page size 4)."""
    hf, ours = pair
    ids = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = _hf_logits(hf, ids)
    kv, backend = _cache(ours)
    kv.add("r")
    kv.resize("r", 10)
    s = kv.slots("r", 0, 10)
    _run(ours, backend, ids[:10], list(range(10)), [SeqAttention(s, 10)], s)
    for pos in range(10, len(ids)):
        kv.resize("r", pos + 1)
        ctx = kv.slots("r", 0, pos + 1)
        logits = _run(ours, backend, [ids[pos]], [pos], [SeqAttention(ctx, 1)], ctx[-1:])
        assert _rel_err(logits[0], ref[pos]) < 1e-4, pos


def test_tree_verify_logits_match_each_path(pair):
    """Every tree node's logits equal transformers' logits on prefix + the node's root-to-node path."""
    hf, ours = pair
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 96, (9,), generator=gen).tolist()
    root = 7
    draft = [11, 12, 13, 14, 15, 16]
    parents = [-1, -1, 0, 0, 2, 1]
    kv, backend = _cache(ours)
    kv.add("r")
    kv.resize("r", len(prefix))
    s = kv.slots("r", 0, len(prefix))
    _run(ours, backend, prefix, list(range(len(prefix))), [SeqAttention(s, len(prefix))], s)
    n = len(draft) + 1
    kv.resize("r", len(prefix) + n)
    ctx = kv.slots("r", 0, len(prefix) + n)
    pos = [len(prefix) + d for d in [0] + depths(parents)]
    logits = _run(ours, backend, [root] + draft, pos, [SeqAttention(ctx, n, ancestor_mask(parents))],
                  ctx[len(prefix):])
    for node in range(n):
        path, j = [], node
        while j > 0:
            path.append(draft[j - 1])
            j = parents[j - 1] + 1
        seq = prefix + [root] + path[::-1]
        assert _rel_err(logits[node], _hf_logits(hf, seq)[-1]) < 1e-4, node


def test_config_reads_llama3_rope_and_gqa(pair, tmp_path):
    _, ours = pair
    cfg = ours.cfg
    assert cfg.kind == "target" and cfg.num_kv_heads in (2, 4)
    raw = json.loads((__import__("pathlib").Path(cfg.path) / "config.json").read_text())
    if raw.get("rope_scaling"):
        assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
