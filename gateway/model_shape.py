"""`ModelShape`: the shape of the model a gateway tokenizes for (its `--model`'s config.json), which a target must
serve: a target of another vocabulary speaks other ids, and one of the same vocabulary but another width or depth
is another model, whose text would come back as this model's with OK (QA: a 4-layer copy of the tiny target
behind a pair served every plain request there)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# (config.json key, GetModelInfo field, how a value of it is said)
FIELDS = (("vocab_size", "vocab_size", "vocabulary {}"), ("hidden_size", "hidden_size", "hidden size {}"),
          ("num_hidden_layers", "num_layers", "{} layers"))


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int = 0  # 0: not known (no config.json, or no such key), not compared
    hidden_size: int = 0
    num_layers: int = 0

    @classmethod
    def from_dir(cls, model_dir: str | Path | None, vocab_size: int) -> ModelShape:
        """`vocab_size` (the tokenizer's reading of config.json, `Tokenizer.model_vocab_size`) and the width and
        depth config.json states; the fields it lacks (or a directory without one) are unknown. A config that does
        not parse is the tokenizer's to refuse (it reads the same file)."""
        path = Path(model_dir) / "config.json" if model_dir else None
        try:
            raw = json.loads(path.read_bytes()) if path is not None and path.is_file() else {}
        except (OSError, ValueError):
            raw = {}
        raw = raw if isinstance(raw, dict) else {}
        return cls(vocab_size, *(_whole(raw.get(key)) for key, _, _ in FIELDS[1:]))

    def misfit(self, info) -> str:
        """Why a target whose GetModelInfo is `info` serves another model ("" when it fits, or is not known)."""
        for _, field, said in FIELDS:
            ours, theirs = getattr(self, field), getattr(info, field)
            if ours and theirs and ours != theirs:
                return (f"it serves {info.model or 'a model'} of {said.format(theirs)}, the gateway's --model has "
                        f"{ours}: not the model this gateway tokenizes for")
        return ""


def _whole(value) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
