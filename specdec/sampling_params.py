"""Per-request sampling parameters and their validation (shared by every service and the in-process engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.errors import InvalidInput

MAX_TOP_K = 1 << 20
MAX_SEED = (1 << 63) - 1
# stop token ids a request may list: 4M of them (repeats of an 8k vocabulary) were forwarded to both services, held
# the call 3.6 s and a concurrent request 1.9 s
MAX_STOP_TOKEN_IDS = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature == 0 means greedy; top_k == 0, top_p == 1 and min_p == 0 switch those filters off.
    seed None means a fresh random stream; a seed makes sampling reproducible for that request.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None, max_new_tokens_limit: int | None = None) -> SamplingParams:
        """Raise InvalidInput naming the first bad field; return self so calls chain."""
        t = self.temperature
        if not (t == t) or t < 0 or t > 100:  # t == t rules out NaN
            raise InvalidInput(f"temperature must be in [0, 100], got {t}")
        if self.top_k < 0 or self.top_k > MAX_TOP_K:
            raise InvalidInput(f"top_k must be in [0, {MAX_TOP_K}] (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise InvalidInput(f"min_p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed <= MAX_SEED):
            raise InvalidInput(f"seed must be in [0, 2^63-1], got {self.seed}")
        if self.max_new_tokens < 1:
            raise InvalidInput(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if max_new_tokens_limit is not None and self.max_new_tokens > max_new_tokens_limit:
            raise InvalidInput(f"max_new_tokens {self.max_new_tokens} exceeds the limit {max_new_tokens_limit}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidInput(f"{len(self.stop_token_ids)} stop_token_ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        if vocab_size is not None:
            bad = [i for i in self.stop_token_ids if not 0 <= i < vocab_size]
            if bad:
                raise InvalidInput(f"stop_token_ids {bad[:4]} outside the vocabulary [0, {vocab_size})")
        return self
