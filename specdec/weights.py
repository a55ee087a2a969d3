"""Reading safetensors checkpoints (single file or sharded with an index); never pickle."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specdec.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

log = logging.getLogger(__name__)


def tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it: the index's map when there is one, else
    `model.safetensors` alone when it is there (as transformers reads it: a stray `model_old.safetensors` beside
    it once replaced its tensors, QA), else every `*.safetensors`, a name in two of them refused."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        return _index_map(model_dir, index)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = sorted(model_dir.glob("*.bin")) + sorted(model_dir.glob("*.pt"))
        hint = " (pickle checkpoints are refused; convert them to safetensors)" if bins else ""
        raise ConfigError(f"{model_dir}: no *.safetensors files{hint}")
    single = model_dir / SINGLE_FILE
    if single in files and len(files) > 1:
        log.warning("%s: reading %s alone, as transformers does (no %s); not read: %s", model_dir, SINGLE_FILE,
                    INDEX_FILE, ", ".join(f.name for f in files if f != single))
        files = [single]
    mapping: dict[str, Path] = {}
    for f in files:
        for name in _keys(f):
            if name in mapping:
                raise ConfigError(f"{model_dir}: tensor {name!r} is in both {mapping[name].name} and {f.name}, and "
                                  f"no {INDEX_FILE} says which to read")
            mapping[name] = f
    return mapping


def _index_map(model_dir: Path, index: Path) -> dict[str, Path]:
    try:
        raw = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{index}: not valid JSON ({exc})") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError(f"{index}: no \"weight_map\" object (tensor name -> shard file)")
    return {name: model_dir / str(fname) for name, fname in weight_map.items()}


def _keys(f: Path) -> list[str]:
    try:
        with safe_open(str(f), framework="pt") as handle:
            return list(handle.keys())
    except SafetensorError as exc:
        raise ConfigError(_unreadable(f, exc)) from None


def _unreadable(f: Path, exc: Exception) -> str:
    return f"{f}: not a readable safetensors file ({exc}): truncated, or still being copied?"


def placed(t: torch.Tensor, dtype: torch.dtype | None, device) -> torch.Tensor:
    """A tensor as read, cast to `dtype` when it is a float one (integer/bool tensors keep theirs), on `device`."""
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.to(device)


def load_tensors(
    model_dir: str | Path,
    names: Iterable[str] | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    on_file=None,
    files: dict[str, Path] | None = None,
) -> dict[str, torch.Tensor]:
    """Load `names` (all tensors when None). Float tensors are cast to `dtype`; integer/bool tensors keep theirs.

    Missing tensors raise ConfigError naming the tensor and the directory.
    `on_file(path, num_tensors)` is called once per file read (start-up progress).
    `files`: the directory's `tensor_files`, when the caller read them already (each file's header read once).
    """
    mapping = tensor_files(model_dir) if files is None else files
    wanted = list(mapping) if names is None else list(names)
    missing = [n for n in wanted if n not in mapping]
    if missing:
        raise ConfigError(f"{model_dir}: tensor {missing[0]!r} not found in the checkpoint ({len(missing)} missing)")
    by_file: dict[Path, list[str]] = {}
    for n in wanted:
        by_file.setdefault(mapping[n], []).append(n)
    out: dict[str, torch.Tensor] = {}
    for f, file_names in by_file.items():
        if not f.is_file():
            raise ConfigError(f"{f}: listed in {INDEX_FILE} but missing")
        try:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                present = set(handle.keys())
                for n in file_names:
                    if n not in present:  # (safetensors' own error names neither the file nor the index)
                        raise ConfigError(f"{f}: has no tensor {n!r}, which {INDEX_FILE} says it holds")
                    out[n] = placed(handle.get_tensor(n), dtype, device)
        except SafetensorError as exc:
            raise ConfigError(_unreadable(f, exc)) from None
        if on_file:
            on_file(f, len(file_names))
    return out

