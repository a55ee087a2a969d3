"""Build target and draft modules and fill them from safetensors (or random weights for benchmarking).

Missing tensors, unexpected tensors and shape mismatches fail with a message that names the tensor and the file.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from specdec.config import ModelConfig, default_aux_layer_inputs
from specdec.errors import ConfigError
from specdec.models.eagle import EagleDraft
from specdec.models.layers import RotaryEmbedding
from specdec.models.llama import LlamaForCausalLM
from specdec.weights import load_tensors, placed, tensor_files

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TARGET_EMBED = "model.embed_tokens.weight"
# an EAGLE-1 export's input norm on its one layer, which the reference EAGLE-1 layer does not have: some training
# code makes the module anyway (then its weight stays at its initial ones: never in the forward, so ignored), other
# code applies it (trained values: applied here too, `ModelConfig.eagle1_input_norm`)
EAGLE1_INPUT_NORM = "layers.0.input_layernorm.weight"
TARGET_LM_HEAD = "lm_head.weight"
ROPE_TABLE = "rotary_emb.inv_freq"


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """`auto` is float32 on CPU (the reference) and bfloat16 on GPU."""
    if name == "auto":
        return torch.float32 if str(device).startswith("cpu") else torch.bfloat16
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; supported: auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _progress(path: Path, n: int) -> None:
    log.info("loaded %d tensors from %s", n, path.name)


def _fill(module: nn.Module, tensors: dict[str, torch.Tensor], where: str, skip: set[str] = frozenset()) -> None:
    params = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    expected = {n for n in params if n not in skip and not n.startswith("rope.")}
    missing = sorted(expected - set(tensors))
    if missing:
        raise ConfigError(f"{where}: tensor {missing[0]!r} not found ({len(missing)} missing)")
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise ConfigError(f"{where}: unexpected tensor {unexpected[0]!r} for {type(module).__name__}")
    with torch.no_grad():
        for name in sorted(expected):
            dst, src = params[name], tensors[name]
            if tuple(dst.shape) != tuple(src.shape):
                raise ConfigError(
                    f"{where}: tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
                )
            dst.copy_(src)


def _build(cls, cfg: ModelConfig, device, dtype, max_positions: int | None):
    """The module's storage allocated once, on `device` and in `dtype` (shaped on `meta`, nothing initialised)."""
    with torch.device("meta"):
        module = cls(cfg, max_positions)
    module = module.to(dtype).to_empty(device=device)
    for buf in module.buffers():  # d2t is loaded later; the rope tables are replaced just below
        buf.zero_()
    # rope tables are computed (float32), not loaded
    module.rope = RotaryEmbedding(cfg.head_dim, max_positions or cfg.max_position_embeddings, cfg.rope_theta,
                                  cfg.rope_scaling).to(device)
    return module


def load_target(
    path: str | Path, dtype: torch.dtype, device="cpu", dummy: bool = False, max_positions: int | None = None
) -> LlamaForCausalLM:
    cfg = ModelConfig.from_hf(path)
    if cfg.kind != "target":
        raise ConfigError(f"{path}: {cfg.architecture} is a draft head, expected a target model")
    files = {} if dummy else _checkpoint_files(path)
    read = {}  # the tensors the tie check read, not read again
    if cfg.tie_word_embeddings and TARGET_LM_HEAD in files:
        tied, read = _ties(path, files)
        if not tied:
            log.warning("%s: config.json ties lm_head to the embeddings, but the checkpoint stores an lm_head of "
                        "other values: that one is used, as transformers 5 does (set tie_word_embeddings to false "
                        "in config.json to silence this)", path)
            cfg = replace(cfg, tie_word_embeddings=False)
    model = _build(LlamaForCausalLM, cfg, device, dtype, max_positions)
    if dummy:
        _random_init(model, seed=0)
    else:
        skip = {TARGET_LM_HEAD} if cfg.tie_word_embeddings else set()
        tensors = load_tensors(path, set(files) - skip - set(read), dtype=dtype, device=device, on_file=_progress,
                               files=files)
        tensors.update({n: placed(t, dtype, device) for n, t in read.items() if n not in skip})
        _fill(model, tensors, str(path), skip=skip)
    model.tie_weights()
    fuse_projections(model)
    return model.eval()


def load_draft(
    path: str | Path,
    target_path: str | Path,
    dtype: torch.dtype,
    device="cpu",
    dummy: bool = False,
    max_positions: int | None = None,
) -> EagleDraft:
    """Load an EAGLE head; the tensors it shares with the target are read from the target checkpoint alone."""
    cfg = ModelConfig.from_hf(path)
    target_cfg = ModelConfig.from_hf(target_path)
    if cfg.kind == "target":
        raise ConfigError(f"{path}: {cfg.architecture} is a target model, expected an EAGLE-1/EAGLE-3 head")
    if cfg.hidden_size != target_cfg.hidden_size or cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(
            f"{path}: draft (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) does not fit the target "
            f"(hidden {target_cfg.hidden_size}, vocab {target_cfg.vocab_size})"
        )
    if cfg.kind == "eagle3" and not cfg.aux_layer_inputs:
        cfg = replace(cfg, aux_layer_inputs=default_aux_layer_inputs(target_cfg.num_layers))
    bad = [i for i in cfg.aux_layer_inputs if not 0 <= i <= target_cfg.num_layers]
    if bad:  # (the library's path took it, and every request then failed InvalidInput: QA)
        raise ConfigError(f"{path}: the head reads the target's hidden states at layer {bad[0]} (of "
                          f"{list(cfg.aux_layer_inputs)}), but {target_path} has {target_cfg.num_layers} layers: the "
                          "head was trained for another target")
    if max_positions is None and target_cfg.max_position_embeddings > cfg.max_position_embeddings:
        # the head's rope table covers every position the target serves: EAGLE heads often list a shorter
        # `max_position_embeddings` than their target (EAGLE3-LLaMA3.1-Instruct-8B: 2048 against 131072; a yarn
        # target's is the stretched one), and a position past the table failed the draft's step (QA: IndexError)
        log.info("%s: max_position_embeddings %d < the target's %d: the head's rope covers the target's", path,
                 cfg.max_position_embeddings, target_cfg.max_position_embeddings)
        max_positions = target_cfg.max_position_embeddings
    draft_files = _checkpoint_files(path) if not dummy else {}
    if cfg.kind == "eagle1" and not dummy and "fc.bias" not in draft_files:
        cfg = replace(cfg, eagle1_fc_bias=False)
    own = {} if dummy else load_tensors(path, set(draft_files), dtype=dtype, device=device, on_file=_progress,
                                        files=draft_files)
    if cfg.kind == "eagle1" and EAGLE1_INPUT_NORM in own:
        cfg = _eagle1_input_norm(cfg, own, path)
    model = _build(EagleDraft, cfg, device, dtype, max_positions)
    if dummy:
        _random_init(model, seed=1)  # d2t stays zero: draft id == target id
        fuse_projections(model)
        return model.eval()
    own.pop("t2d", None)  # the draft->target map d2t is all we need
    if "d2t" in own:
        _check_d2t(own["d2t"], cfg.vocab_size, path)
    # an EAGLE-3 head over the whole target vocabulary may ship no map: d2t stays zero (draft id == target id)
    skip = {"d2t"} if cfg.kind == "eagle3" and "d2t" not in own and cfg.draft_vocab_size == cfg.vocab_size else set()
    shared = _shared_from_target(cfg, target_cfg, target_path, dtype, device, have=own)
    _fill(model, {**shared, **own}, str(path), skip=skip)
    fuse_projections(model)
    return model.eval()


def _check_d2t(d2t: torch.Tensor, vocab_size: int, path) -> None:
    """A head's draft->target map (target id = draft id + d2t[draft id]) names target ids only: one outside the
    vocabulary failed every request's first draft step (IndexError on a CPU, a device assert on a GPU: QA)."""
    ids = torch.arange(d2t.numel(), device=d2t.device) + d2t.reshape(-1).long()
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ConfigError(f"{path}: d2t maps draft id {i} to {int(ids[i])}, outside the target's vocabulary "
                          f"[0, {vocab_size}) ({bad.numel()} such ids): the map belongs to another target")


def _eagle1_input_norm(cfg: ModelConfig, own: dict[str, torch.Tensor], path) -> ModelConfig:
    """An EAGLE-1 export with an input norm on its layer: ignored (dropped from `own`) while its weight is all
    ones, as made and never trained; applied when it holds trained values."""
    if bool((own[EAGLE1_INPUT_NORM] == 1).all()):
        del own[EAGLE1_INPUT_NORM]
        log.info("%s: %s is all ones (never trained): ignored, as the EAGLE-1 layer has no input norm", path,
                 EAGLE1_INPUT_NORM)
        return cfg
    log.info("%s: %s holds trained values: the head's layer normalizes its input", path, EAGLE1_INPUT_NORM)
    return replace(cfg, eagle1_input_norm=True)


def _ties(path, files: dict[str, Path]) -> tuple[bool, dict[str, torch.Tensor]]:
    """Whether a target whose config ties lm_head to the embeddings is tied, and the two tensors as stored (read
    once, for the caller to use): when the checkpoint stores an lm_head too, tied only where its values are the
    embeddings' (transformers 5 keeps a stored lm_head of other values; before, it was dropped with a warning and
    the logits were not transformers', QA)."""
    both = load_tensors(path, {TARGET_EMBED, TARGET_LM_HEAD}, files=files)  # as stored
    embed, head = both[TARGET_EMBED], both[TARGET_LM_HEAD]
    return embed.shape == head.shape and torch.equal(embed, head.to(embed.dtype)), both


def target_lm_head(target_path, target_cfg: ModelConfig,
                   files: dict[str, Path]) -> tuple[str, dict[str, torch.Tensor]]:
    """The target checkpoint's tensor its lm_head is (`load_target`'s reading of a tied config): an EAGLE-1 head
    without its own shares it. Also the tensors the tie check read as stored (empty when none was needed).
    `files`: the target's `_checkpoint_files`."""
    if not target_cfg.tie_word_embeddings:
        return TARGET_LM_HEAD, {}
    if TARGET_LM_HEAD not in files:
        return TARGET_EMBED, {}
    tied, read = _ties(target_path, files)
    return (TARGET_EMBED if tied else TARGET_LM_HEAD), read


def _checkpoint_files(path) -> dict[str, Path]:
    """`tensor_files` less the rope tables old Llama-2 conversions carry (computed here, never loaded)."""
    return {n: f for n, f in tensor_files(path).items() if not n.endswith(ROPE_TABLE)}


def fuse_projections(model: nn.Module) -> None:
    """q/k/v and gate/up as single matmuls (fewer kernel launches per layer); weights stay where they are."""
    for module in model.modules():
        if hasattr(module, "fuse"):
            module.fuse()


def _shared_from_target(cfg, target_cfg, target_path, dtype, device, have) -> dict:
    """embed_tokens (both formats) and lm_head (EAGLE-1) from the target unless the head ships its own; each
    target tensor (and the checkpoint's index) is read once."""
    wanted, read = {}, {}
    if "embed_tokens.weight" not in have:
        wanted["embed_tokens.weight"] = TARGET_EMBED
    if cfg.kind == "eagle1" and "lm_head.weight" not in have:
        wanted["lm_head.weight"] = None
    if not wanted:
        return {}
    files = _checkpoint_files(target_path)
    if "lm_head.weight" in wanted:
        wanted["lm_head.weight"], read = target_lm_head(target_path, target_cfg, files)
    tensors = {n: placed(t, dtype, device) for n, t in read.items() if n in wanted.values()}
    tensors.update(load_tensors(target_path, set(wanted.values()) - set(tensors), dtype=dtype, device=device,
                                files=files))
    return {mine: tensors[theirs] for mine, theirs in wanted.items()}


def _random_init(model: nn.Module, seed: int) -> None:
    """Random weights of the right shape (`--load-format dummy`), generated on the model's device."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                p.normal_(0.0, 0.02, generator=gen)

