"""Model configuration read once from a Hugging Face checkpoint directory (`config.json`)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

from specdec.errors import ConfigError

log = logging.getLogger(__name__)
# what the model code computes: a SiLU-gated MLP without biases, full attention without biases (a config asking
# for anything else is refused by name: QA found gelu MLPs and Mistral's sliding window loaded and computed wrong)
SUPPORTED_ACTS = ("silu", "swish")
_WINDOW_SAID: set[str] = set()  # checkpoints whose sliding-window cap was logged

TARGET_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM")
EAGLE1_ARCHS = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM")
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


# rope scalings the model code computes as transformers does (others, e.g. longrope, are refused by name)
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """A `rope_scaling` other than the default: `models.layers.rope_inv_freq` and `RotaryEmbedding` turn it into
    the cos/sin tables as transformers' `modeling_rope_utils` does (dynamic: the default rope, which is what
    transformers computes over the `max_position_embeddings` positions specdec serves). `rope_type` says which
    fields below are read; the others keep their defaults. Yarn's `attention_factor` is resolved here once (from
    `mscale` / `mscale_all_dim` / `factor` when the config does not give it), so the model code reads one number."""

    rope_type: str  # "linear", "dynamic", "yarn" or "llama3"
    factor: float
    original_max_position_embeddings: int | None = None  # llama3, yarn: the pre-training context
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn: rotations above which a frequency is kept
    beta_slow: float = 1.0  # yarn: rotations below which a frequency is divided by `factor`
    truncate: bool = True  # yarn: round the blend's band outwards to whole dimensions
    attention_factor: float = 1.0  # yarn: multiplies cos and sin (so every q.k by its square)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and kind of a target or draft model. `kind` is "target", "eagle1" or "eagle3"."""

    path: str
    kind: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    # EAGLE-3 only: size of the draft vocabulary (== vocab_size when there is no reduced vocab)
    draft_vocab_size: int
    # EAGLE-3 only: target layers whose residual-stream *inputs* form the feature, in order
    aux_layer_inputs: tuple[int, ...]
    eagle1_fc_bias: bool = True
    # EAGLE-1 only: its layer normalizes its input (an export whose `layers.0.input_layernorm.weight` was trained;
    # the reference EAGLE-1 layer has no input norm: `models.loader.EAGLE1_INPUT_NORM`)
    eagle1_input_norm: bool = False

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json`; a name from `specdec.models.presets` (e.g. "llama3-8b") gives that shape."""
        from specdec.models.presets import PRESETS

        if str(path) in PRESETS and not Path(path).is_dir():
            return cls.from_dict(PRESETS[str(path)], str(path))
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ConfigError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{cfg_file}: not valid JSON ({exc})") from exc
        cfg = cls.from_dict(raw, str(path))
        gen_file = path / "generation_config.json"
        if gen_file.is_file() and cfg.kind == "target":
            try:
                gen = json.loads(gen_file.read_text())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"{gen_file}: cannot read ({exc})") from exc
            cfg = replace(cfg, eos_token_ids=eos_token_ids(gen if isinstance(gen, dict) else {}, raw, gen_file))
        return cfg

    @classmethod
    def from_dict(cls, raw: dict, path: str = "<memory>") -> ModelConfig:
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}/config.json: not a JSON object")
        archs = raw.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch in TARGET_ARCHS:
            kind = "target"
        elif arch in EAGLE1_ARCHS:
            kind = "eagle1"
        elif arch in EAGLE3_ARCHS:
            kind = "eagle3"
        else:
            supported = ", ".join(TARGET_ARCHS + EAGLE1_ARCHS + EAGLE3_ARCHS)
            raise ConfigError(f"{path}: unsupported architecture {arch!r}; supported: {supported}")
        try:
            hidden = int(raw["hidden_size"])
            num_heads = int(raw["num_attention_heads"])
            num_layers = int(raw["num_hidden_layers"])
            vocab = int(raw["vocab_size"])
            intermediate = int(raw["intermediate_size"])
            num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
            head_dim = int(raw.get("head_dim") or (hidden // num_heads if num_heads > 0 else 0))
            draft_vocab = int(raw.get("draft_vocab_size") or vocab)
        except KeyError as exc:
            raise ConfigError(f"{path}/config.json: missing field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{path}/config.json: a size field is not a whole number ({exc})") from exc
        sizes = {"hidden_size": hidden, "num_attention_heads": num_heads, "num_hidden_layers": num_layers,
                 "vocab_size": vocab, "intermediate_size": intermediate, "num_key_value_heads": num_kv_heads,
                 "head_dim": head_dim, "draft_vocab_size": draft_vocab}
        bad = next((k for k, v in sizes.items() if v <= 0), None)
        if bad is not None:  # (0 heads divided by zero; a negative context failed in torch: QA)
            raise ConfigError(f"{path}/config.json: {bad} must be a positive whole number, not {sizes[bad]}")
        try:
            eps = float(raw.get("rms_norm_eps", 1e-6))
        except (TypeError, ValueError):
            raise ConfigError(f"{path}/config.json: rms_norm_eps {raw.get('rms_norm_eps')!r} is not a number") \
                from None
        _check_computable(raw, path)
        rope_theta, rope_scaling = _rope(raw, path)
        eos_ids = eos_token_ids({}, raw, path)
        return cls(
            path=path,
            kind=kind,
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            rms_norm_eps=eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_max_positions(raw, path),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)) and kind != "eagle3",
            eos_token_ids=eos_ids,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            draft_vocab_size=draft_vocab,
            aux_layer_inputs=_aux_layer_inputs(raw, kind),
        )


def eos_token_ids(gen_config: dict, model_config: dict, where: object = "") -> tuple[int, ...]:
    """The ids a completion ends at, as transformers' `generate` reads them: `generation_config.json`'s
    `eos_token_id` when it has one, else `config.json`'s (an int or a list). The target engine and the gateway's
    tokenizer read them alike: before, the target read config.json's alone, so a model whose end-of-turn id is
    only in generation_config.json (Llama-3-Instruct's 128009) ran past it on `TargetService.Generate` (QA)."""
    value = gen_config.get("eos_token_id", model_config.get("eos_token_id"))
    try:
        if value is None:
            return ()
        return (int(value),) if isinstance(value, int | str) else tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: eos_token_id {value!r} is not a token id or a list of them") from None


def _check_computable(raw: dict, path: str) -> None:
    """Refuse config fields that change what the model computes and that the model code does not implement."""
    act = raw.get("hidden_act") or raw.get("hidden_activation") or "silu"
    if act not in SUPPORTED_ACTS:
        raise ConfigError(f"{path}: hidden_act {act!r} is not supported (supported: silu: a SiLU-gated MLP)")
    for flag in ("attention_bias", "mlp_bias"):
        if raw.get(flag):
            raise ConfigError(f"{path}: {flag}=true is not supported (projections without biases only)")


def _is_mistral(raw: dict) -> bool:
    return (raw.get("architectures") or [""])[0] == "MistralForCausalLM"


def _declared_positions(raw: dict, path: str) -> int:
    """`max_position_embeddings` as transformers reads it: the key's value, else its default (2048 for Llama, 131072
    for Mistral)."""
    most = raw.get("max_position_embeddings")
    if most is None:
        return 131072 if _is_mistral(raw) else 2048
    try:
        most = int(most)
    except (TypeError, ValueError):
        raise ConfigError(f"{path}/config.json: max_position_embeddings {most!r} is not a whole number") from None
    if most <= 0:
        raise ConfigError(f"{path}/config.json: max_position_embeddings must be a positive whole number, not {most}")
    return most


def _max_positions(raw: dict, path: str) -> int:
    """`max_position_embeddings` (`_declared_positions`), capped at a Mistral `sliding_window` below it: attention
    over a window is not implemented, and within the window full attention is the same thing (past it, it is not:
    QA). A Mistral config without the key has transformers' window of 4096; one whose key is null has none."""
    most = _declared_positions(raw, path)
    window = raw.get("sliding_window", 4096 if _is_mistral(raw) else None)
    try:
        window = int(window) if window else None
    except (TypeError, ValueError):
        raise ConfigError(f"{path}/config.json: sliding_window {window!r} is not a whole number") from None
    if window and raw.get("use_sliding_window", True) and window < most:
        if path in _WINDOW_SAID:  # (a draft reads its target's config several times at start)
            return window
        _WINDOW_SAID.add(path)
        log.warning("%s: sliding_window %d < max_position_embeddings %d: the context is capped at %d (attention "
                    "over a sliding window is not implemented; within it, it is full attention)", path, window,
                    most, window)
        return window
    return most


def _rope(raw: dict, path: str) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) read as transformers 5 reads them (`convert_rope_params_to_dict`, `standardize_rope_params`):
    the legacy `rope_scaling` object when set, else `rope_parameters`; the theta inside that object, else the
    top-level `rope_theta`, else 10000; a llama3 or yarn scaling's pre-training context: a top-level
    `original_max_position_embeddings`, else the object's, else `max_position_embeddings`. Before, the top-level
    theta won over the object's and a llama3 scaling without its own context length took 8192: a config whose
    fields disagree (transformers 5 writes both) gave other logits than transformers' (QA)."""
    rs = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if not isinstance(rs, dict):
        raise ConfigError(f"{path}: rope_scaling must be an object, not {type(rs).__name__}")
    try:
        theta = float(rs.get("rope_theta") or raw.get("rope_theta") or 10000.0)
    except (TypeError, ValueError):
        raise ConfigError(f"{path}: rope_theta is not a number") from None
    rs, declared = dict(rs), _declared_positions(raw, path)
    if raw.get("original_max_position_embeddings") is not None:
        rs["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    elif rs.get("original_max_position_embeddings") is None:
        rs["original_max_position_embeddings"] = declared
    return theta, _parse_rope_scaling(rs, path, declared)


def _parse_rope_scaling(rs: dict, path: str, max_positions: int) -> RopeScaling | None:
    """The scaling a `rope_scaling` object asks for; None for the default rope. Refused by name: a type the model
    code does not compute (longrope, ...), a missing or non-positive `factor` (transformers refuses a missing one;
    for one <= 0 it only warns and computes NaN or mirrored positions), a field that is not a number. A yarn
    `factor` given as null is `max_positions` over the pre-training context, as transformers derives it (DeepSeek-V3
    style configs)."""
    rope_type = rs.get("rope_type") or rs.get("type")
    if rope_type in (None, "default"):
        return None
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{path}: rope_scaling type {rope_type!r} is not supported (supported: "
                          f"{', '.join(ROPE_TYPES)})")
    factor = _number(rs, "factor", path)
    if factor is None and rope_type == "yarn" and "factor" in rs and rs.get("original_max_position_embeddings"):
        factor = max_positions / _number(rs, "original_max_position_embeddings", path)
    if factor is None:
        raise ConfigError(f"{path}: rope_scaling of type {rope_type} needs a \"factor\"")
    if not factor > 0:
        raise ConfigError(f"{path}: rope_scaling factor must be > 0, not {rs['factor']!r}")
    original = rs.get("original_max_position_embeddings")
    if original is not None:
        original = int(_number(rs, "original_max_position_embeddings", path))
        if original <= 0:
            raise ConfigError(f"{path}: rope_scaling original_max_position_embeddings must be > 0, not {original}")
    elif rope_type in ("llama3", "yarn"):
        raise ConfigError(f"{path}: rope_scaling of type {rope_type} needs \"original_max_position_embeddings\" (or "
                          "a max_position_embeddings to take it from)")
    if rope_type == "llama3":
        return RopeScaling("llama3", factor, original, _number(rs, "low_freq_factor", path, 1.0),
                           _number(rs, "high_freq_factor", path, 4.0))
    if rope_type == "yarn":
        return _parse_yarn(rs, factor, original, path)
    return RopeScaling(rope_type, factor)  # linear, dynamic: the factor alone


def _parse_yarn(rs: dict, factor: float, original: int, path: str) -> RopeScaling:
    """Yarn's fields with transformers' defaults (`_compute_yarn_parameters`): a beta that is absent or 0 is 32 /
    1; `truncate` absent is true (null is false, as there); `attention_factor` absent is YaRN's
    `0.1 * ln(factor) + 1` (1 for factor <= 1), or the ratio of that with `mscale` over that with `mscale_all_dim`
    when both are set and non-zero (DeepSeek-style configs)."""
    truncate = rs.get("truncate", True)
    if truncate is not None and not isinstance(truncate, bool):
        raise ConfigError(f"{path}: rope_scaling truncate must be true or false, not {truncate!r}")
    attention = _number(rs, "attention_factor", path, None)
    if attention is None:
        mscale, mscale_all_dim = _number(rs, "mscale", path, 0.0), _number(rs, "mscale_all_dim", path, 0.0)
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor, 1.0)
    if not attention > 0:
        raise ConfigError(f"{path}: rope_scaling attention_factor must be > 0, not {attention!r}")
    betas = _number(rs, "beta_fast", path, 0.0) or 32.0, _number(rs, "beta_slow", path, 0.0) or 1.0
    if min(betas) < 0:
        raise ConfigError(f"{path}: rope_scaling beta_fast and beta_slow must be > 0, not {betas[0]} / {betas[1]}")
    return RopeScaling("yarn", factor, original, beta_fast=betas[0], beta_slow=betas[1], truncate=bool(truncate),
                       attention_factor=attention)


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention temperature (paper eq. 21): the longer the stretch, the sharper the attention."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _number(rs: dict, key: str, path: str, default: float | None = None) -> float | None:
    """`rs[key]` as a float; `default` when it is absent or null."""
    value = rs.get(key)
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{path}: rope_scaling has a field that is not a number ({key}: {value!r})") from None


def _aux_layer_inputs(raw: dict, kind: str) -> tuple[int, ...]:
    """EAGLE-3 aux features as target layer *inputs*.

    `eagle_config.eagle_aux_hidden_state_layer_ids` lists layer outputs (SGLang's convention: id i = output of
    layer i = input of layer i+1). Without it the default is the inputs of layers [2, L//2, L-3] of the target,
    whose layer count an EAGLE-3 config gives as `target_num_hidden_layers` (resolved by the caller otherwise).
    """
    if kind != "eagle3":
        return ()
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) + 1 for i in ids)
    target_layers = raw.get("target_num_hidden_layers")
    if target_layers:
        return default_aux_layer_inputs(int(target_layers))
    return ()


def default_aux_layer_inputs(num_target_layers: int) -> tuple[int, ...]:
    n = num_target_layers
    return (2, n // 2, n - 3)
