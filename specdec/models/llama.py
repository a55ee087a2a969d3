"""The target: a Llama-family decoder. `forward(ids, positions, batch) -> hidden`; logits are a separate call."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdec.attention.batch import AttentionBatch
from specdec.config import ModelConfig
from specdec.models.layers import DecoderLayer, Linear, RMSNorm, RotaryEmbedding, enter_layer


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # [num_tokens, hidden] final normed hidden state (the input of lm_head)
    aux: torch.Tensor | None  # [num_tokens, len(aux_layers) * hidden] residual-stream inputs of aux layers


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBackbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        backend,
        batch: AttentionBatch,
        aux_layers: tuple[int, ...] = (),
    ) -> TargetOutput:
        x = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = None  # the residual stream x is still to be added to (each layer's last add is fused forward)
        aux = []
        rot = self.rope.at(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            normed, stream = enter_layer(layer.input_layernorm, x, residual)  # stream: the input of layer i
            if i in aux_layers:
                aux.append(stream)
            x, residual = layer(normed, stream, rot, backend, batch)
        hidden, stream = enter_layer(self.model.norm, x, residual)
        if len(self.model.layers) in aux_layers:  # "input of layer L" = the residual stream before the final norm
            aux.append(stream)
        aux_out = None
        if aux_layers:
            by_layer = dict(zip(sorted(set(aux_layers)), aux, strict=True))
            aux_out = torch.cat([by_layer[i] for i in aux_layers], dim=-1)
        return TargetOutput(hidden=hidden, aux=aux_out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] float32
        return self.lm_head(hidden).float()
