"""Routing over the configured draft/target pairs: least-loaded, health-checked, sticky for a request's lifetime.

Each pair is up or down per part (draft, target). A pair whose target is up takes requests; one whose draft
is up too serves them speculatively, otherwise through the target's plain Generate. `acquire` picks the pair
with the fewest streams in flight among the best class (speculative pairs first when the request wants
speculation), round-robin among equals; the request keeps its `Lease` (and so its pair) until it ends, unless
the pair fails under it. A part that fails a call is marked down at once (`report_failure`); the health loop
probes every part (every 0.25 s while some part is down) and brings it back when it answers SERVING again; an
up part that does not answer is marked down after `MISSED_CHECKS_DOWN` checks in a row (one is a busy service
more often than a dead one). The log says each part's state at its first check (one found down: a WARNING
saying why) and then each change, never the same state twice in a row.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc.aio

from gateway.config import PairAddress
from gateway.downstream import DraftClient, Health, HealthCheck, TargetClient
from gateway.model_shape import ModelShape
from specdec.errors import NotReady
from specdec.rpc.tls import TlsConfig
from specdec.spec_params import TREE_CAP_FIELDS

log = logging.getLogger(__name__)

FAST_POLL_S = 0.25  # health-check interval while some part of some pair is down
# health checks in a row that get no answer before a part that is up is marked down. One unanswered check is
# a busy service more often than a dead one (seen on a 2-core CPU under one long request: down, then up 0.25 s
# later, refusing new requests in between); a dead one refuses the connection (down at once), and a failing
# call marks its part down at once whatever the checks say.
MISSED_CHECKS_DOWN = 3
CALL_FAILED = "call failed"  # what the state log holds of a part `report_failure` took out
# after waiting for a pair, how long a speculative request also waits for a draft to come up (`acquire_waiting`)
DRAFT_GRACE_S = 3.0


class Part(enum.Enum):
    DRAFT = "draft"
    TARGET = "target"


def _up_attr(part: Part) -> str:
    """The `Pair` field that says whether `part` is up."""
    return "draft_up" if part is Part.DRAFT else "target_up"


@dataclass
class Pair:
    index: int
    address: PairAddress
    target: TargetClient
    draft: DraftClient | None
    target_up: bool = False
    draft_up: bool = False
    in_flight: int = 0
    target_model: str = ""  # from GetModelInfo once the target was seen up
    draft_model: str = ""
    max_context_len: int = 0  # 0: not known yet
    draft_shape: dict[str, int] | None = None  # its draft's tree shape (num_steps, topk, num_draft_tokens), once seen
    draft_max_context_len: int = 0  # the longest context its draft drafts for (0: not known yet)
    # per part: set when health checks mark it down for not answering (a frozen or unreachable service), so the
    # streams running on it stop waiting for it (`FallbackGeneration`); a fresh one once it is up again
    unresponsive: dict[Part, asyncio.Event] = field(
        default_factory=lambda: {Part.DRAFT: asyncio.Event(), Part.TARGET: asyncio.Event()})

    @property
    def usable(self) -> bool:
        return self.target_up

    @property
    def speculative(self) -> bool:
        return self.target_up and self.draft is not None and self.draft_up

    def is_up(self, part: Part) -> bool:
        return getattr(self, _up_attr(part))

    def __str__(self) -> str:
        return f"pair {self.index} ({self.address})"


@dataclass
class Lease:
    """A request's hold on a pair; `Router.release` gives it back (once)."""

    pair: Pair
    released: bool = field(default=False, compare=False)


class Router:
    def __init__(self, pairs: Sequence[Pair], health_interval_s: float = 2.0,
                 shape: ModelShape = ModelShape()) -> None:
        """`shape`: the model the gateway tokenizes for (its `--model`'s config.json; fields 0: unknown): a target
        whose model has another vocabulary, width or depth is kept down (`ModelShape.misfit`)."""
        self.pairs = list(pairs)
        self._health_interval_s = health_interval_s
        self._shape = shape
        # a round-robin turn per kind of request: one counter for both sent alternating speculative and plain
        # requests of 2 pairs all to one pair each (QA: drafts served [0, 6] of 6)
        self._turns = {True: itertools.count(), False: itertools.count()}
        self._health_tasks: list[asyncio.Task] = []
        self._missed: dict[tuple[int, Part], int] = {}  # (pair index, part) -> unanswered health checks in a row
        # (pair index, part) -> the states logged since it last went up or down ("up", or the `Health` values it
        # was found down with, CALL_FAILED after `report_failure`); absent: not checked yet
        self._said: dict[tuple[int, Part], set[str]] = {}
        self.any_up = asyncio.Event()
        # set (then replaced) each time a pair becomes usable or speculative: `acquire_waiting`
        self._came_up = asyncio.Event()

    @classmethod
    def connect(cls, addresses: Sequence[PairAddress], tls: TlsConfig | None, health_interval_s: float,
                shape: ModelShape = ModelShape()) -> Router:
        pairs = [
            Pair(i, addr, TargetClient(addr.target, tls), DraftClient(addr.draft, tls) if addr.draft else None)
            for i, addr in enumerate(addresses)
        ]
        return cls(pairs, health_interval_s, shape)

    # -- leases ---------------------------------------------------------------------------------------------
    def acquire(self, speculative: bool, exclude: Sequence[Pair] = (),
                fit: Callable[[Pair], bool] | None = None) -> Lease:
        """The least-loaded usable pair (speculative pairs first if `speculative`, among them those whose draft
        `fit` accepts: a request's own tree shape); NotReady when none."""
        candidates = [p for p in self.pairs if p.usable and p not in exclude]
        if not candidates:
            raise self._none_available()
        turn = next(self._turns[speculative])
        n = len(self.pairs)

        def rank(pair: Pair) -> tuple[bool, int, int]:
            drafts = pair.speculative and (fit is None or fit(pair))
            return (speculative and not drafts, pair.in_flight, (pair.index - turn) % n)

        pair = min(candidates, key=rank)
        pair.in_flight += 1
        return Lease(pair)

    async def acquire_waiting(self, speculative: bool, wait_s: float, exclude: Sequence[Pair] = (),
                              fit: Callable[[Pair], bool] | None = None) -> Lease:
        """`acquire`, but when no pair outside `exclude` is usable, wait up to `wait_s` for one to come up (a pair's
        target back after a restart, `exclude`d ones included: a request that left a failed pair may go back to it
        once it answers SERVING again); NotReady when none did."""
        with contextlib.suppress(NotReady):
            return self.acquire(speculative, exclude, fit)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(wait_s, 0.0)
        while not any(p.usable for p in self.pairs):
            left = deadline - loop.time()
            if left <= 0:
                raise self._none_available(f" in {wait_s:g} s" if wait_s > 0 else "")
            await self._until_change(left)
        # a pair back from a restart: its draft answers once it has seen its target again (`TargetWatch`), a check or
        # two later; a speculative request waits that long for it rather than run to its end plainly (QA: 1 of 2)
        until = min(loop.time() + DRAFT_GRACE_S, deadline)
        while speculative and self._draft_coming() and loop.time() < until:
            await self._until_change(until - loop.time())
        return self.acquire(speculative, fit=fit)

    def _none_available(self, waited: str = "") -> NotReady:
        down = ", ".join(str(p.address) for p in self.pairs)
        return NotReady(f"no draft/target pair is available{waited} (pairs: {down}); retry later")

    def _draft_coming(self) -> bool:
        """No usable pair speculates, and one has a draft that is down (maybe back a check or two later)."""
        usable = [p for p in self.pairs if p.usable]
        return not any(p.speculative for p in usable) and any(p.draft is not None for p in usable)

    async def _until_change(self, timeout_s: float) -> None:
        """Until a pair becomes usable or speculative, or `timeout_s` passed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._came_up.wait(), max(timeout_s, 0.0))

    def release(self, lease: Lease) -> None:
        if not lease.released:
            lease.released = True
            lease.pair.in_flight -= 1

    async def switch(self, lease: Lease, speculative: bool, wait_s: float,
                     fit: Callable[[Pair], bool] | None = None) -> Lease:
        """Move a request off its failed pair onto another one, waiting up to `wait_s` for one (or the failed one,
        back) to come up when none is usable (`acquire_waiting`)."""
        self.release(lease)
        return await self.acquire_waiting(speculative, wait_s, exclude=[lease.pair], fit=fit)

    def report_failure(self, pair: Pair, part: Part, reason: str) -> None:
        """Take `part` of `pair` out of rotation until a health check finds it SERVING again."""
        attr = _up_attr(part)
        if getattr(pair, attr):
            log.warning("%s: %s marked down (%s)", pair, part.value, reason)
            self._said[(pair.index, part)] = {CALL_FAILED}
        setattr(pair, attr, False)

    @property
    def pairs_up(self) -> int:
        return sum(p.usable for p in self.pairs)

    # -- health ---------------------------------------------------------------------------------------------
    async def check_once(self) -> None:
        await asyncio.gather(*(self._check_pair(pair) for pair in self.pairs))

    async def _check_pair(self, pair: Pair) -> None:
        """Both parts at once (one after the other, a silent target delayed its draft's check by its deadline)."""
        parts = [(Part.TARGET, pair.target)] + ([(Part.DRAFT, pair.draft)] if pair.draft is not None else [])
        was_usable, was_speculative = pair.usable, pair.speculative
        await asyncio.gather(*(self._check_part(pair, part, client) for part, client in parts))
        if self.pairs_up:
            self.any_up.set()
        if (pair.usable and not was_usable) or (pair.speculative and not was_speculative):
            # requests waiting for a pair (or for its draft, `acquire_waiting`) take it; both parts judged first
            self._came_up.set()
            self._came_up = asyncio.Event()

    async def _check_part(self, pair: Pair, part: Part, client: TargetClient | DraftClient) -> None:
        client.renew_channel()  # renewed TLS files: new connections present (and trust) the new certificates
        check = await client.probe()
        up = self._judge(pair, part, check)
        if up and not pair.is_up(part):
            if part is Part.DRAFT:  # (a draft that does not fit its target says so itself: NOT_SERVING)
                await self._learn_draft(pair)
            elif misfit := await self._learn_target(pair):
                # (QA: a target restarted as another model served its ids to this tokenizer, and OK)
                check, up = HealthCheck(Health.MISFIT, misfit), False
        self._set(pair, part, up, check)

    def _judge(self, pair: Pair, part: Part, check: HealthCheck) -> bool:
        """Up or down after this check: an unanswered check keeps an up part up until MISSED_CHECKS_DOWN in a
        row; a part that is down comes back only on SERVING."""
        key = (pair.index, part)
        if check.health is Health.STALLED:  # it answers, but its engine does not move: as if it did not answer
            self._missed.pop(key, None)
            pair.unresponsive[part].set()
            return False
        if check.health is not Health.NO_ANSWER:
            self._missed.pop(key, None)
            return check.health is Health.SERVING
        self._missed[key] = missed = self._missed.get(key, 0) + 1
        if pair.is_up(part) and missed < MISSED_CHECKS_DOWN:
            log.info("%s: %s did not answer a health check (%d in a row)", pair, part.value, missed)
            return True
        pair.unresponsive[part].set()  # the streams running on it stop waiting for it
        return False

    def _set(self, pair: Pair, part: Part, up: bool, check: HealthCheck) -> None:
        setattr(pair, _up_attr(part), up)
        if up and pair.unresponsive[part].is_set():
            pair.unresponsive[part] = asyncio.Event()
        self._log_state(pair, part, up, check)

    def _log_state(self, pair: Pair, part: Part, up: bool, check: HealthCheck) -> None:
        """Log `part`'s state at its first check, then when it goes up or down (a WARNING when it is found down,
        with why), and while down each other reason once (refused, then NOT_SERVING while it loads). A part that
        stays as it was logs nothing more."""
        key = (pair.index, part)
        state = "up" if up else check.health.value
        said = self._said.get(key)
        if said is not None and state in said:
            return
        first, was_up = said is None, said is not None and "up" in said
        had_streams = was_up or (said is not None and CALL_FAILED in said)
        if first or up or was_up:  # a change of up / down starts the record over
            said = self._said[key] = set()
        said.add(state)
        addr = pair.target.addr if part is Part.TARGET else pair.draft.addr
        if up:
            log.info("%s: %s %s is up", pair, part.value, addr)
            return
        why = check.why
        if check.health is Health.NO_ANSWER:
            missed = self._missed.get(key, 0)
            why += f" ({missed} checks in a row)" if missed > 1 else ""
            why += "; its streams move on" if had_streams else ""
        level, still = (logging.WARNING, "") if first or was_up else (logging.INFO, "still ")
        log.log(level, "%s: %s %s is %sdown: %s", pair, part.value, addr, still, why)

    async def _learn_target(self, pair: Pair) -> str:
        """What a target that came up serves; why it does not fit the gateway ("" when it does, or is not known):
        then nothing of it is kept (the model card and the context checks read what is)."""
        with contextlib.suppress(grpc.aio.AioRpcError):
            info = await pair.target.model_info()
            if misfit := self._shape.misfit(info):
                return misfit
            pair.target_model, pair.max_context_len = info.model, info.max_context_len
        return ""

    async def _learn_draft(self, pair: Pair) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            info = await pair.draft.model_info()
            pair.draft_model, pair.draft_max_context_len = info.model, info.max_context_len
            if all(info.spec.HasField(f) for f in TREE_CAP_FIELDS):
                pair.draft_shape = {f: getattr(info.spec, f) for f in TREE_CAP_FIELDS}

    async def _health_loop(self, pair: Pair) -> None:
        """One pair's checks: each pair keeps its own pace, so a pair that never answers (each check waits out its
        deadline) does not slow the others' (QA: a frozen target was found 5.5 s after it stopped beside such a
        pair, 3.6 s without)."""
        while True:
            try:
                await self._check_pair(pair)
            except Exception:  # a bug here must not stop routing; the next round tries again
                log.exception("health check of %s failed", pair)
            # fast while a part is down or did not answer: back (or out) within a second
            await asyncio.sleep(FAST_POLL_S if self._unsettled(pair) else self._health_interval_s)

    def _unsettled(self, pair: Pair) -> bool:
        down = not pair.target_up or (pair.draft is not None and not pair.draft_up)
        return down or any(index == pair.index for index, _ in self._missed)

    def start(self) -> None:
        """Start the background health loops, one a pair (call inside the event loop)."""
        if not self._health_tasks:
            self._health_tasks = [asyncio.create_task(self._health_loop(pair), name=f"gateway-health-{pair.index}")
                                  for pair in self.pairs]

    async def close(self) -> None:
        for task in self._health_tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for pair in self.pairs:
            await pair.target.close()
            if pair.draft is not None:
                await pair.draft.close()
