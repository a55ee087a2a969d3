"""Attention backends over the paged KV cache, chosen by name at start-up."""

from __future__ import annotations

from specdec.attention.batch import AttentionBatch, SeqAttention
from specdec.attention.torch_backend import TorchAttention
from specdec.errors import ConfigError

BACKENDS = {"torch": TorchAttention}


def register_backend(name: str, cls) -> None:
    BACKENDS[name] = cls


def make_backend(name: str, kv_cache, num_qo_heads: int, triton_queries: int = 1, triton_trees: bool = False):
    """`triton_queries`: small causal forwards of up to this many tokens per sequence may attend through the
    one-kernel Triton attention (flashinfer backend; `attention/triton_decode.py`); `triton_trees`: small tree
    verifies too."""
    if name == "flashinfer" and name not in BACKENDS:
        try:
            from specdec.attention import flashinfer_backend  # noqa: F401  (registers itself)
        except ImportError as exc:
            raise ConfigError(f"attention backend 'flashinfer' needs the gpu extra ({exc})") from exc
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; supported: {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name](kv_cache, num_qo_heads, triton_queries=triton_queries, triton_trees=triton_trees)


__all__ = ["AttentionBatch", "SeqAttention", "make_backend", "register_backend", "BACKENDS"]
