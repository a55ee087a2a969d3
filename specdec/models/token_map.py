"""A draft vocabulary for an EAGLE-1 head (`--token-map FILE`): its lm_head keeps only the rows of the listed target
tokens, so each draft step reads that fraction of the target's lm_head instead of all of it, and proposes only those
tokens. For an 8B-shaped target (128k vocabulary, 1.05 GB of lm_head in bf16) the lm_head is ~2/3 of what an EAGLE-1
draft step reads; the tokens a text uses are a small part of the vocabulary (the tiny pair's EAGLE-3 head covers
92.7% of its training tokens with half of it). Lossless: the target verifies every token, and verification takes
the draft's tokens as given (`specdec.verify`: deterministic top-k drafting, no draft probabilities), so a token
outside the map is never proposed but is still produced by the target whenever it is right. What it costs is
acceptance where the text needs a token outside the map (measured in docs/benchmarks.md).

The file is JSON: `{"token_ids": [...]}` (what `specdec token-map` writes) or a bare list of target token ids,
distinct, inside the target's vocabulary. `specdec token-map` writes one: the most frequent tokens of a corpus
under the target's tokenizer, or the draft vocabulary of an EAGLE-3 head trained for the same target. An EAGLE-3
head has its own draft vocabulary and takes no map.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from specdec.errors import ConfigError

FLAG = "--token-map"


def read_token_map(path: str | Path, vocab_size: int) -> list[int]:
    """The target token ids of a token-map file, checked against a vocabulary of `vocab_size` (ConfigError)."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{FLAG} {path}: cannot read it ({exc.strerror or exc})") from exc
    except ValueError as exc:
        raise ConfigError(f"{FLAG} {path}: not JSON ({exc})") from exc
    ids = raw.get("token_ids") if isinstance(raw, dict) else raw
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"{FLAG} {path}: expected a non-empty JSON list of token ids (or {{\"token_ids\": [...]}})")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ConfigError(f"{FLAG} {path}: token ids {bad[:4]} outside the target's vocabulary [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        dup = sorted(i for i, n in Counter(ids).items() if n > 1)
        raise ConfigError(f"{FLAG} {path}: token ids listed more than once: {dup[:4]}")
    return ids


def write_token_map(ids: Iterable[int], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"token_ids": [int(i) for i in ids]}) + "\n")


def eagle3_draft_vocab(head_dir: str | Path) -> list[int]:
    """The target ids of an EAGLE-3 head's draft vocabulary (draft id i is target id i + d2t[i])."""
    from specdec.weights import load_tensors, tensor_files

    files = tensor_files(head_dir)
    if "d2t" not in files:
        raise ConfigError(f"{head_dir}: no d2t tensor: not an EAGLE-3 head with a draft vocabulary")
    d2t = load_tensors(head_dir, {"d2t"}, files=files)["d2t"].long()
    return (torch.arange(d2t.numel()) + d2t).tolist()


def most_frequent(counts: Counter, size: int) -> list[int]:
    """The `size` most frequent token ids, most frequent first (ties: the smaller id)."""
    return [tok for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]]


def count_tokens(encode, texts: Iterable[str]) -> Counter:
    counts: Counter = Counter()
    for text in texts:
        counts.update(encode(text))
    return counts
