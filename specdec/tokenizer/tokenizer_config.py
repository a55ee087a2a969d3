"""`TokenizerConfig`: what a model directory says about its tokenizer, apart from the vocabulary file.

Read from the HF files next to the vocabulary, each optional: `tokenizer_config.json` (added tokens,
bos/eos names, chat template, an optional `pat_str`), `chat_template.jinja`, `generation_config.json` and
`config.json` (eos ids, logits width).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specdec.config import eos_token_ids
from specdec.errors import ConfigError


@dataclass(frozen=True)
class TokenizerConfig:
    added_tokens: dict[str, int] = field(default_factory=dict)  # text -> id, from `added_tokens_decoder`
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None
    chat_template_origin: str | None = None  # the file it came from (named in its errors)
    pat_str: str | None = None
    eos_token_ids: tuple[int, ...] = ()  # generation_config / config `eos_token_id`
    model_vocab_size: int | None = None  # config.json `vocab_size` (embedding rows)

    @classmethod
    def from_dir(cls, model_dir: Path | None) -> TokenizerConfig:
        if model_dir is None:
            return cls()
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        gen_config = _read_json(model_dir / "generation_config.json")
        model_config = _read_json(model_dir / "config.json")
        template, origin = _chat_template(model_dir, tok_config)
        return cls(
            added_tokens=_added_tokens(tok_config),
            bos_token=_token_name(tok_config.get("bos_token")),
            eos_token=_token_name(tok_config.get("eos_token")),
            chat_template=template,
            chat_template_origin=origin,
            pat_str=tok_config.get("pat_str"),
            eos_token_ids=eos_token_ids(gen_config, model_config, model_dir),
            model_vocab_size=_vocab_size(model_config),
        )


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: cannot read ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return data


def _added_tokens(tok_config: dict) -> dict[str, int]:
    decoder = tok_config.get("added_tokens_decoder") or {}
    return {entry["content"]: int(token_id) for token_id, entry in decoder.items()}


def _token_name(value: object) -> str | None:
    if isinstance(value, dict):  # {"content": "<|eot_id|>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(model_dir: Path, tok_config: dict) -> tuple[str | None, str | None]:
    """(the template's source, the file it came from)."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        by_name = {item.get("name"): item.get("template") for item in template}
        template = by_name.get("default")
    if not isinstance(template, str):
        return None, None
    return template, str(model_dir / "tokenizer_config.json")


def _vocab_size(model_config: dict) -> int | None:
    size = model_config.get("vocab_size") or model_config.get("text_config", {}).get("vocab_size")
    return int(size) if size else None
