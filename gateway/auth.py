"""API keys: `--api-key-file` holds one key per line; callers send `authorization: Bearer <key>`.

Keys are compared in constant time (`hmac.compare_digest`, against every key, whatever matches), so the
time a check takes does not tell a caller how much of a key was right. A call without a valid key ends with
UNAUTHENTICATED before it reaches the servicer. Health checks are not covered (probes carry no key).

The file is read again when it changes (`ApiKeyFile`, looked at once a second at most): a key added works and a
key removed is refused from the first call after that, without a restart (a rotated Secret, a revoked key). A new
version with no key, or that cannot be read, is refused with a WARNING and the keys before stay in force.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import grpc.aio

from gateway.interceptors import BehaviorInterceptor
from specdec.errors import ConfigError
from specdec.rpc.errors import end_call
from specdec.rpc.file_watch import FileWatch

AUTH_HEADER = "authorization"
SCHEME = "bearer "
REJECTION = "missing or invalid API key: send the metadata 'authorization: Bearer <key>'"


def load_api_keys(path: str | Path) -> tuple[bytes, ...]:
    """Non-empty lines of `path`, stripped; lines starting with '#' are comments. ConfigError if none."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the API key file {path}: {exc.strerror}") from exc
    keys = tuple(line.strip().encode() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ConfigError(f"the API key file {path} holds no key")
    return keys


class ApiKeyFile:
    """The keys of `--api-key-file` as they are now: `keys()` (the file looked at again once `LOOK_S` has passed)."""

    LOOK_S = 1.0

    def __init__(self, path: str | Path) -> None:
        self._watch = FileWatch([str(path)], lambda: load_api_keys(path), f"the API key file {path}")
        self._next_look = time.monotonic() + self.LOOK_S

    def keys(self) -> tuple[bytes, ...]:
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + self.LOOK_S
            self._watch.changed()
        return self._watch.taken


def key_matches(presented: bytes, keys: tuple[bytes, ...]) -> bool:
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key)
    return matched


def client_identity(context: grpc.aio.ServicerContext, by_key: bool) -> str:
    """Who a stream belongs to, for per-client limits: the API key (a digest of it) when keys are checked,
    else the peer's host (a client choosing its own token must not be able to pick a fresh identity)."""
    if by_key:
        token = bearer_token(context)
        if token:
            return "key:" + hashlib.sha256(token).hexdigest()[:16]
    peer = context.peer() or ""
    return "peer:" + peer.rsplit(":", 1)[0]


def bearer_token(context: grpc.aio.ServicerContext) -> bytes | None:
    for key, value in context.invocation_metadata() or ():
        if key == AUTH_HEADER:
            text = value if isinstance(value, str) else value.decode(errors="replace")
            if text[: len(SCHEME)].lower() == SCHEME:
                return text[len(SCHEME) :].strip().encode()
    return None


class ApiKeyInterceptor(BehaviorInterceptor):
    def __init__(self, keys: tuple[bytes, ...] | ApiKeyFile) -> None:
        """`keys`: fixed ones, or an `ApiKeyFile` read again when it changes."""
        self._keys: Callable[[], tuple[bytes, ...]] = keys.keys if isinstance(keys, ApiKeyFile) else lambda: keys

    def _allowed(self, context: grpc.aio.ServicerContext) -> bool:
        """Does the call carry a key? If not, its status is set and the wrapper returns (`end_call`: a refused
        call's request is freed with it)."""
        token = bearer_token(context)
        if token is None or not key_matches(token, self._keys()):
            end_call(context, grpc.StatusCode.UNAUTHENTICATED, REJECTION)
            return False
        return True

    def wrap_unary(self, behavior, method: str):
        async def checked(request, context):
            if not self._allowed(context):
                return None
            return await behavior(request, context)

        return checked

    def wrap_stream(self, behavior, method: str):
        async def checked(request, context):
            if not self._allowed(context):
                return
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return checked
