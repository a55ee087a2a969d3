"""EAGLE draft heads (EAGLE-1 and EAGLE-3). Both map (token ids, features) -> hidden; logits are separate.

EAGLE-1 (`LlamaForCausalLMEagle`): x = fc(cat(embed(token), feature)); one decoder layer without input norm (an
export that trained one: with it, `Eagle1Layer`);
no final norm; logits through the target's lm_head (or the rows of a token map: `restrict_vocab`). The feature is
the target's final normed hidden state at the previous position, or at later draft steps the head's own output.

EAGLE-3 (`LlamaForCausalLMEagle3`): g = fc(cat(aux features)) (3H -> H) for target features, or the head's own
pre-norm output at later steps; attention reads cat(input_layernorm(embed), hidden_norm(g)) (2H wide), the
residual stream carries g; logits = lm_head(norm(out)) over a reduced draft vocab mapped to target ids by d2t.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from specdec.attention.batch import AttentionBatch
from specdec.config import ModelConfig
from specdec.errors import ConfigError
from specdec.models.layers import MLP, Attention, Linear, RMSNorm, RotaryEmbedding


class Eagle1Layer(nn.Module):
    """The reference EAGLE-1 layer has no input norm; an export that trained one (`cfg.eagle1_input_norm`) gets it
    before attention, as a Llama layer has it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.eagle1_input_norm else None
        self.self_attn = Attention(cfg, 0)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rot, backend, batch):
        attn_in = x if self.input_layernorm is None else self.input_layernorm(x)
        normed, x = self.post_attention_layernorm.add(self.self_attn(attn_in, rot, backend, batch), x)
        return x + self.mlp(normed)


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 0, input_size=2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, embeds, g, rot, backend, batch):
        attn_in = torch.cat([self.input_layernorm(embeds), self.hidden_norm(g)], dim=-1)
        normed, x = self.post_attention_layernorm.add(self.self_attn(attn_in, rot, backend, batch), g)
        return x + self.mlp(normed)


class EagleDraft(nn.Module):
    """One module for both formats; `cfg.kind` picks the layout. Shares the target's embedding (and, for
    EAGLE-1, its lm_head), which the loader passes in."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        if cfg.kind == "eagle1":
            self.fc = Linear(2 * h, h, bias=cfg.eagle1_fc_bias)
            self.layers = nn.ModuleList([Eagle1Layer(cfg)])
            self.lm_head = Linear(h, cfg.vocab_size, bias=False)
            self.register_buffer("d2t", None)  # set by `restrict_vocab` (a token map)
        else:
            self.fc = Linear(len(cfg.aux_layer_inputs or (0, 0, 0)) * h, h, bias=False)
            self.midlayer = Eagle3MidLayer(cfg)
            self.norm = RMSNorm(h, cfg.rms_norm_eps)
            self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.rope = RotaryEmbedding(
            cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )

    @property
    def feature_size(self) -> int:
        """Width of the target feature this head consumes."""
        return self.fc.in_features - self.cfg.hidden_size if self.cfg.kind == "eagle1" else self.fc.in_features

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64 target-vocab ids
        features: torch.Tensor,  # [num_tokens, feature_size] target features or [num_tokens, hidden] own output
        positions: torch.Tensor,  # [num_tokens]
        backend,
        batch: AttentionBatch,
    ) -> torch.Tensor:  # [num_tokens, hidden] pre-norm output (next step's input hidden)
        embeds = self.embed_tokens(input_ids).to(features.dtype)
        if self.cfg.kind == "eagle1":
            x = self.fc(torch.cat([embeds, features], dim=-1))
            return self.layers[0](x, self.rope.at(positions, x.dtype), backend, batch)
        g = self.fc(features) if features.shape[-1] != self.cfg.hidden_size else features
        return self.midlayer(embeds, g, self.rope.at(positions, g.dtype), backend, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, draft_vocab] float32
        if self.cfg.kind == "eagle1":
            return self.lm_head(hidden).float()
        return self.lm_head(self.norm(hidden)).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def restrict_vocab(self, token_ids: list[int]) -> None:
        """Keep only `token_ids` (target ids, an EAGLE-1 head's token map: `specdec.models.token_map`) as the draft
        vocabulary: the lm_head keeps their rows (a copy: the target's own lm_head is left whole), and draft id i
        stands for target id token_ids[i]."""
        if self.cfg.kind != "eagle1" or self.d2t is not None:
            raise ConfigError("--token-map applies to an EAGLE-1 head; an EAGLE-3 head has its own draft vocabulary")
        weight = self.lm_head.weight
        ids = torch.tensor(token_ids, dtype=torch.int64, device=weight.device)
        head = Linear(self.cfg.hidden_size, len(token_ids), bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            head.weight.copy_(weight[ids])
        self.lm_head = head.requires_grad_(False)
        self.d2t = ids - torch.arange(len(token_ids), device=weight.device)
        self.cfg = replace(self.cfg, draft_vocab_size=len(token_ids))
