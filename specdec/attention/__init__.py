"""Attention backends over the paged KV cache, chosen by name at start-up."""

from __future__ import annotations

from specdec.attention.batch import AttentionBatch, SeqAttention
from specdec.attention.torch_backend import TorchAttention
from specdec.errors import ConfigError

BACKENDS = {"torch": TorchAttention}


def register_backend(name: str, cls) -> None:
    BACKENDS[name] = cls


def check_backend(name: str, device: str | None = None) -> None:
    """Raise ConfigError, naming the flag, unless backend `name` can run here: a known one whose package imports
    (flashinfer: the `gpu` extra), flashinfer on a CUDA `device` (None: not checked). `EngineOptions.validate`
    calls it before any weights load; `make_backend` again."""
    if name == "flashinfer":
        _import_flashinfer()
        if device is not None and not device.startswith("cuda"):
            raise ConfigError(f"--attention-backend flashinfer needs a CUDA device (--device cuda or cuda:N), not "
                              f"{device!r}; --attention-backend torch runs on a CPU")
    if name not in BACKENDS:
        known = ", ".join(sorted({*BACKENDS, "flashinfer"}))
        raise ConfigError(f"unknown --attention-backend {name!r}; supported: {known}")


def _import_flashinfer() -> None:
    """Register the flashinfer backend and import flashinfer itself (its module imports it only when used)."""
    try:
        from specdec.attention.flashinfer_backend import import_flashinfer  # registers the backend

        import_flashinfer()
    except ImportError as exc:
        raise ConfigError(f"--attention-backend flashinfer needs the flashinfer package, which does not import here "
                          f"({exc}): install the gpu extra, pip install -e '.[gpu]' (flashinfer-python), or run "
                          "with --attention-backend torch, which needs no extra package") from exc


def make_backend(name: str, kv_cache, num_qo_heads: int, triton_queries: int = 1, triton_trees: bool = False):
    """`triton_queries`: small causal forwards of up to this many tokens per sequence may attend through the
    one-kernel Triton attention (flashinfer backend; `attention/triton_decode.py`); `triton_trees`: small tree
    verifies too."""
    check_backend(name)
    return BACKENDS[name](kv_cache, num_qo_heads, triton_queries=triton_queries, triton_trees=triton_trees)


__all__ = ["AttentionBatch", "SeqAttention", "check_backend", "make_backend", "register_backend", "BACKENDS"]
