"""Llama building blocks: RMSNorm, rotary embedding, gated MLP and attention over an attention backend."""

from __future__ import annotations

import math

import torch
from torch import nn

from specdec.attention.batch import AttentionBatch
from specdec.config import ModelConfig, RopeScaling
from specdec.kernels import attention_fused, fused, linear


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and checkpoint names) whose products go through `kernels.linear` (one row or a
    few: Triton kernels)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_ok(x, self.weight):
            from specdec.kernels.norm import rmsnorm

            return rmsnorm(x, self.weight, self.eps)
        # HF semantics: normalise in float32, cast back, then scale
        normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add and the norm after it, fused on GPU."""
        if _fused_ok(x, self.weight) and residual.dtype == x.dtype and residual.stride(-1) == 1:
            from specdec.kernels.norm import rmsnorm

            return rmsnorm(x, self.weight, self.eps, residual)
        summed = residual + x
        return self.forward(summed), summed


def _fused_ok(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dim() == 2 and x.dtype == weight.dtype and x.stride(-1) == 1 and fused(x)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The rotary frequencies, as transformers computes them for each `rope_type` (`modeling_rope_utils`):

    - default, dynamic: `theta ** (-2i / head_dim)`. Dynamic NTK raises theta only once a forward's longest
      sequence passes `max_position_embeddings`, which is the most positions specdec serves: within them it is
      the default rope, exactly (a growing theta cannot be exact with a paged cache anyway: keys written earlier
      stay rotated with the theta of their time).
    - linear: divided by `factor` (positions squeezed `factor` times).
    - llama3, yarn: long wavelengths divided by `factor`, short ones kept, a blend in between (`_llama3_*`,
      `_yarn_*`).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))  # [head_dim / 2]
    if scaling is None or scaling.rope_type == "dynamic":
        return inv_freq.float()
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).float()
    if scaling.rope_type == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling).float()
    return _llama3_inv_freq(inv_freq, scaling).float()


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama-3: wavelengths longer than `original / low_freq_factor` divided by `factor`, shorter than
    `original / high_freq_factor` kept, a smooth blend in between."""
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(mid, blended, out)


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN ("NTK-by-parts"): a frequency that turns more than `beta_fast` times over the pre-training context is
    kept, one that turns fewer than `beta_slow` times is divided by `factor`, and a linear ramp over the
    dimensions between blends the two. Worked example: head_dim 16, theta 1e4, original 32, betas 32 / 1 give
    the band [-1.6, 1.4], truncated outwards and clamped to [0, 2]: pair 0 kept, pair 1 half-and-half, pairs 2-7
    divided by `factor`."""
    original = scaling.original_max_position_embeddings

    def dim_of(rotations: float) -> float:  # the (fractional) dimension whose frequency turns `rotations` times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (as transformers: no division by zero)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # 0 kept, 1 scaled
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by position (HF's rotate-half layout). Yarn's attention factor multiplies
    both tables, as transformers multiplies its cos and sin: the torch path and the fused `rope_store` kernel
    read it with them."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        attention_factor = scaling.attention_factor if scaling is not None else 1.0
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rotation:
        """The rotation for this forward's positions, shared by every layer."""
        return Rotation(self.cos, self.sin, positions, dtype)


class Rotation:
    """Rotary embedding at given positions. The torch path gathers cos/sin rows once (on first use); the fused
    GPU kernel (`rope_store`) reads the float32 tables by position itself."""

    def __init__(self, cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype):
        self.cos_table, self.sin_table = cos_table, sin_table  # [max_positions, head_dim] float32
        self.positions, self.dtype = positions, dtype  # [num_tokens] int64
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor):
        if self._gathered is None:  # [num_tokens, 1, head_dim] each
            self._gathered = (self.cos_table[self.positions].unsqueeze(1).to(self.dtype),
                              self.sin_table[self.positions].unsqueeze(1).to(self.dtype))
        cos, sin = self._gathered
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

        self.gate_up: torch.Tensor | None = None  # [2 * intermediate, hidden] after fuse()

    def fuse(self) -> None:
        """One matmul for gate and up: the two weights become views of one tensor (no extra memory)."""
        fused = torch.cat([self.gate_proj.weight.data, self.up_proj.weight.data])
        n = self.gate_proj.out_features
        self.gate_proj.weight.data, self.up_proj.weight.data = fused[:n], fused[n:]
        self.gate_up = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = linear(x, self.gate_up)
        if fused(gate_up):
            from specdec.kernels.activation import silu_mul

            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class Attention(nn.Module):
    """Self-attention of one layer; K/V go to the paged cache through `backend`."""

    def __init__(self, cfg: ModelConfig, layer_id: int, input_size: int | None = None):
        super().__init__()
        in_size = input_size or cfg.hidden_size
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(in_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = Linear(in_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = Linear(in_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5
        self.qkv: torch.Tensor | None = None  # [(heads + 2 * kv_heads) * head_dim, in] after fuse()

    def fuse(self) -> None:
        """One matmul for q, k and v: the three weights become views of one tensor (no extra memory)."""
        fused = torch.cat([self.q_proj.weight.data, self.k_proj.weight.data, self.v_proj.weight.data])
        nq, nk = self.q_proj.out_features, self.k_proj.out_features
        self.q_proj.weight.data, self.k_proj.weight.data = fused[:nq], fused[nq : nq + nk]
        self.v_proj.weight.data = fused[nq + nk :]
        self.qkv = fused

    def _project(self, x):
        if self.qkv is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        nq, nk = self.q_proj.out_features, self.k_proj.out_features
        return linear(x, self.qkv).split([nq, nk, nk], dim=-1)

    def forward(self, x, rot: Rotation, backend, batch: AttentionBatch) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self._project(x)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if getattr(backend, "fuses_rope", False) and fused(q) and attention_fused(self.head_dim):  # one kernel
            out = backend.forward_rope(self.layer_id, q, k, v, rot, batch)
        else:
            q, k = rot(q, k)
            out = backend.forward(self.layer_id, q, k, v, batch, self.scale)  # [n, heads, head_dim]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    """Pre-norm Llama decoder layer after its input norm. The residual add that ends a layer runs fused with the
    norm that begins the next one (or the final norm), so `forward` returns the MLP's output and the residual
    stream apart."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, normed, stream, rot, backend, batch):
        """normed = input_layernorm(stream) (see `enter_layer`), stream = the layer's input. Returns (the MLP's
        output, the residual stream it is to be added to)."""
        h = self.self_attn(normed, rot, backend, batch)
        normed, stream = self.post_attention_layernorm.add(h, stream)
        return self.mlp(normed), stream


def enter_layer(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None):
    """(norm(x + residual), x + residual): a layer's input norm over the previous layer's last add (one kernel on
    the GPU), or (norm(x), x) for the embeddings."""
    return (norm(x), x) if residual is None else norm.add(x, residual)
