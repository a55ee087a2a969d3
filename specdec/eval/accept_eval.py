"""`specdec accept-eval`: acceptance length (tau), losslessness and speed of speculative vs plain decoding.

Runs in-process (no gRPC) on the torch backend. Greedy outputs are compared token for token with target-only
decoding; a difference at a position where the target's top two logits are within `near_tie` counts as a
near-tie (numerical noise decides such positions), every other difference as a mismatch.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass

from specdec.engine.draft_engine import DraftEngine, SpecConfig
from specdec.engine.generate import generate
from specdec.engine.requests import GenerationResult
from specdec.engine.target_engine import TargetEngine
from specdec.errors import ConfigError
from specdec.sampling_params import SamplingParams

NEAR_TIE = 1e-4


@dataclass(frozen=True)
class EvalSettings:
    max_new_tokens: int = 64
    max_prompt_tokens: int = 256
    temperature: float = 0.0
    batch_size: int = 1
    seed: int = 0
    near_tie: float = NEAR_TIE  # top-2 logit gap under which a greedy difference is numerical noise


def read_prompts(path: str, limit: int | None) -> list[str]:
    """The "prompt" of each JSONL line (ConfigError naming the file and line when it cannot be read, or when it holds
    none: an empty file divided by zero after the models loaded, QA)."""
    prompts = []
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        prompts.append(json.loads(line)["prompt"])
                    except (ValueError, KeyError, TypeError) as exc:
                        raise ConfigError(f"--prompts {path}, line {number}: expected a JSON object with a "
                                          f"\"prompt\" ({type(exc).__name__}: {exc})") from exc
                if limit and len(prompts) >= limit:
                    break
    except OSError as exc:
        raise ConfigError(f"--prompts {path}: cannot read it ({exc.strerror or exc})") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--prompts {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    if not prompts:
        raise ConfigError(f"--prompts {path}: no prompts in it")
    return prompts


def _timed(target, draft, prompts, params, batch_size) -> tuple[list[GenerationResult], float]:
    t0 = time.perf_counter()
    out = []
    for i in range(0, len(prompts), batch_size):
        out += generate(target, draft, prompts[i : i + batch_size], params[i : i + batch_size], batch_size)
    return out, time.perf_counter() - t0


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top_two_gap(target: TargetEngine, prompt: list[int], prefix: list[int]) -> float:
    """The gap between the target's two largest logits after `prompt + prefix`."""
    top2 = target.prompt_logits(prompt + prefix)[-1].topk(2).values
    return float((top2[0] - top2[1]).abs().item())


def run_accept_eval(
    target: TargetEngine, draft: DraftEngine, prompt_ids: list[list[int]], settings: EvalSettings,
    tie_reference: TargetEngine | None = None,
) -> dict:
    """`tie_reference`: the engine whose logits judge a near-tie (default `target`): a bf16 target's own top-two gap
    is rounded to its logits' precision (1/8 at 16), so a GPU test judges with a float32 one."""
    params = [
        SamplingParams(temperature=settings.temperature, max_new_tokens=settings.max_new_tokens,
                       seed=None if settings.temperature == 0 else settings.seed + i)
        for i in range(len(prompt_ids))
    ]
    spec, spec_s = _timed(target, draft, prompt_ids, params, settings.batch_size)
    plain, plain_s = _timed(target, None, prompt_ids, params, settings.batch_size)
    steps = sum(r.num_verify_steps for r in spec)
    committed = sum(len(r.tokens) - 1 for r in spec)  # the prefill's first token is not a verify step's
    hist: Counter[int] = Counter()
    per_pos: list[int] = []
    for r in spec:
        hist.update(r.accept_lengths)
        for i, n in enumerate(r.accepted_per_position):
            per_pos += [0] * (i + 1 - len(per_pos))
            per_pos[i] += n
    mismatches, near_ties, checked = [], [], 0
    if settings.temperature == 0:
        for i, (s, p) in enumerate(zip(spec, plain, strict=True)):
            checked += 1
            pos = first_difference(s.tokens, p.tokens)
            if pos is None:
                continue
            entry = {"prompt": i, "position": pos}
            near = False  # a length difference is never a tie
            if pos < min(len(s.tokens), len(p.tokens)):
                entry["gap"] = round(top_two_gap(tie_reference or target, prompt_ids[i], p.tokens[:pos]), 4)
                near = entry["gap"] < settings.near_tie
            (near_ties if near else mismatches).append(entry)
    # steps that ended a request were cut at max_new_tokens/EOS; without them tau is the pure acceptance rate
    mid = [n for r in spec for n in r.accept_lengths[:-1]]
    spec_tokens = sum(len(r.tokens) for r in spec)
    plain_tokens = sum(len(r.tokens) for r in plain)
    return {
        "tau": round(committed / steps, 4) if steps else 0.0,
        "tau_excluding_final_steps": round(sum(mid) / len(mid), 4) if mid else 0.0,
        "prompts": len(prompt_ids),
        "target_steps": steps,
        "lossless_checked": checked,
        "lossless_mismatches": len(mismatches),
        "mismatch_positions": mismatches,
        "near_tie_mismatches": near_ties,
        "accepted_per_position": per_pos,
        "accept_len_hist": dict(sorted(hist.items())),
        "tokens_per_s_spec": round(spec_tokens / spec_s, 2),
        "tokens_per_s_plain": round(plain_tokens / plain_s, 2),
        "speedup": round((spec_tokens / spec_s) / (plain_tokens / plain_s), 3),
        "settings": {**asdict(settings), **asdict(draft.spec), "draft_kind": draft.model.cfg.kind},
    }


def spec_from_args(args) -> SpecConfig:
    return SpecConfig(args.num_steps, args.topk, args.num_draft_tokens)
