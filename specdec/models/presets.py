"""Named model shapes for `--load-format dummy --config NAME`: benchmark large shapes without checkpoints.

Shapes follow the public Llama-3.1-8B config and EAGLE heads built for it (one decoder layer, hidden 4096).
"""

from __future__ import annotations

_LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "eos_token_id": [128001, 128009], "torch_dtype": "bfloat16",
}

PRESETS: dict[str, dict] = {
    "llama3-8b": _LLAMA3_8B,
    "llama3-8b-eagle1": {**_LLAMA3_8B, "architectures": ["LlamaForCausalLMEagle"], "num_hidden_layers": 1},
    "llama3-8b-eagle3": {**_LLAMA3_8B, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
                         "draft_vocab_size": 32000,
                         "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}},
}


def preset_names() -> str:
    return ", ".join(sorted(PRESETS))
