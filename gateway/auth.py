"""API keys: `--api-key-file` holds one key per line; callers send `authorization: Bearer <key>`.

Keys are held as SHA-256 digests, and a presented key is checked by looking its digest up: the time a check
takes tells a caller nothing about how much of a key was right (it depends on the digest, which no prefix of a key
predicts), nor does it grow with the number of keys (comparing against each key in turn made 100k keys cost every
call ~7 ms of the event loop, QA); the keys themselves are not kept in memory. A call without a valid key ends with
UNAUTHENTICATED before it reaches the servicer. Health checks are not covered (probes carry no key).

The file is read again when it changes (`ApiKeyFile`, looked at once a second at most): a key added works and a
key removed is refused from the first call after that, without a restart (a rotated Secret, a revoked key). A new
version with no key, or that cannot be read, is refused with a WARNING and the keys before stay in force.
"""

from __future__ import annotations

import contextlib
import hashlib
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
    """Non-empty lines of `path`, stripped; lines starting with '#' are comments (a UTF-8 byte-order mark is not
    part of the first key). ConfigError if none, or if the file cannot be read as UTF-8."""
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read the API key file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"the API key file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    keys = tuple(line.strip().encode() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ConfigError(f"the API key file {path} holds no key")
    return keys


class ApiKeyFile:
    """The keys of `--api-key-file` as they are now: `keys()` (the file looked at again once `LOOK_S` has passed)."""

    LOOK_S = 1.0

    def __init__(self, path: str | Path) -> None:
        self._watch = FileWatch([str(path)], lambda: key_digests(load_api_keys(path)), f"the API key file {path}")
        self._next_look = time.monotonic() + self.LOOK_S

    def keys(self) -> frozenset[bytes]:
        now = time.monotonic()
        if now >= self._next_look:
            self._next_look = now + self.LOOK_S
            self._watch.changed()
        return self._watch.taken


def key_digests(keys: tuple[bytes, ...]) -> frozenset[bytes]:
    return frozenset(hashlib.sha256(key).digest() for key in keys)


def key_matches(presented: bytes, digests: frozenset[bytes]) -> bool:
    return hashlib.sha256(presented).digest() in digests


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
        if isinstance(keys, ApiKeyFile):
            self._keys: Callable[[], frozenset[bytes]] = keys.keys
        else:
            digests = key_digests(keys)
            self._keys = lambda: digests

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
