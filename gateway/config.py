"""Gateway settings: the draft/target pairs it routes over and the limits it enforces, built once from flags."""

from __future__ import annotations

from dataclasses import dataclass

from specdec.errors import ConfigError
from specdec.rpc.address import address_problem

DEFAULT_MAX_NEW_TOKENS_LIMIT = 4096
DEFAULT_MAX_NEW_TOKENS = 128  # when a request does not say (capped by the limit)
# characters of one input (a prompt, a chat's contents, a Tokenize text), checked before tokenizing: a 50 MB
# Tokenize held the event loop ~3 s building and sending its 21M ids, and a 50 MB chat took 5-6 s of CPU to be
# refused. 4 Mi characters is ~1M tokens of code, beyond any context served today.
DEFAULT_MAX_INPUT_CHARS = 4 << 20
# messages of one chat, checked before any work per message: the template renders each in Python (holding the GIL
# even on a worker thread), and 1M one-character messages (11 MB) took 9.5 s of CPU to be refused as too long while
# the gateway's other calls waited behind them (QA). 4096 render in ~16 ms.
MAX_CHAT_MESSAGES = 4096
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_MODEL_NAME_CHARS = 256
# how long a request waits for a pair when none is up (a new one, or a stream whose pair failed under it): a pair
# restarting (`specdec up` brings a killed target back in ~5 s on a CPU, a Pod in tens of seconds on a GPU) is
# waited out rather than failing the streams it served; within the client's deadline
DEFAULT_PAIR_WAIT_S = 30.0


@dataclass(frozen=True)
class PairAddress:
    """One draft/target pair: `draft` None means the pair has no draft (the target's plain Generate only)."""

    draft: str | None
    target: str

    @classmethod
    def parse(cls, spec: str) -> PairAddress:
        """`"draft:50051=target:50052"`, or `"=target:50052"` for a target without a draft."""
        draft, sep, target = spec.partition("=")
        draft, target = draft.strip(), target.strip()
        if not sep or not target:
            raise ConfigError(f"--pair {spec!r}: expected DRAFT_HOST:PORT=TARGET_HOST:PORT (or =TARGET_HOST:PORT)")
        for addr in (draft, target):
            problem = address_problem(addr) if addr else None
            if problem:
                raise ConfigError(f"--pair {spec!r}: {problem}")
        return cls(draft=draft or None, target=target)

    def __str__(self) -> str:
        return f"{self.draft or ''}={self.target}"


@dataclass(frozen=True)
class GatewayLimits:
    """Per-request and per-gateway limits; None means unlimited."""

    max_prompt_tokens: int | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS_LIMIT
    max_concurrent_streams: int | None = None
    max_streams_per_client: int | None = None  # per API key when keys are on, else per peer host
    max_input_chars: int = DEFAULT_MAX_INPUT_CHARS

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_new_tokens", "max_concurrent_streams", "max_streams_per_client",
                     "max_input_chars"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")

    @property
    def default_max_new_tokens(self) -> int:
        return min(DEFAULT_MAX_NEW_TOKENS, self.max_new_tokens)


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: str  # target model dir: tokenizer and chat template
    pairs: tuple[PairAddress, ...]
    limits: GatewayLimits = GatewayLimits()
    health_interval_s: float = 2.0  # how often pairs are health-checked (faster while none is up)
    served_model_name: str = ""  # the model id ListModels reports; "": the target's model name
    pair_wait_s: float = DEFAULT_PAIR_WAIT_S  # a request's wait for a pair while none is up (0: UNAVAILABLE at once)

    def __post_init__(self) -> None:
        if not self.pairs:
            raise ConfigError("the gateway needs at least one --pair DRAFT=TARGET (or =TARGET)")
        twice = sorted({str(p) for p in self.pairs if self.pairs.count(p) > 1})
        if twice:  # it doubled the pair's metric series and its share of the load (QA)
            raise ConfigError(f"--pair {twice[0]} is given more than once")
        if not self.pair_wait_s >= 0:
            raise ConfigError(f"--pair-wait-seconds must be at least 0, got {self.pair_wait_s}")
        name = self.served_model_name
        if name and (len(name) > MAX_MODEL_NAME_CHARS or not name.isprintable() or name != name.strip()):
            raise ConfigError(f"--served-model-name {name!r}: expected up to {MAX_MODEL_NAME_CHARS} printable "
                              "characters without leading or trailing spaces")

