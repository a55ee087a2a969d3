"""Reading safetensors checkpoints (single file or sharded with an index); never pickle."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from specdec.errors import ConfigError

INDEX_FILE = "model.safetensors.index.json"


def tensor_files(model_dir: str | Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        bins = sorted(model_dir.glob("*.bin")) + sorted(model_dir.glob("*.pt"))
        hint = " (pickle checkpoints are refused; convert them to safetensors)" if bins else ""
        raise ConfigError(f"{model_dir}: no *.safetensors files{hint}")
    mapping: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                mapping[name] = f
    return mapping


def load_tensors(
    model_dir: str | Path,
    names: Iterable[str] | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    on_file=None,
) -> dict[str, torch.Tensor]:
    """Load `names` (all tensors when None). Float tensors are cast to `dtype`; integer/bool tensors keep theirs.

    Missing tensors raise ConfigError naming the tensor and the directory.
    `on_file(path, num_tensors)` is called once per file read (start-up progress).
    """
    mapping = tensor_files(model_dir)
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
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for n in file_names:
                t = handle.get_tensor(n)
                if dtype is not None and t.is_floating_point():
                    t = t.to(dtype)
                out[n] = t.to(device)
        if on_file:
            on_file(f, len(file_names))
    return out

