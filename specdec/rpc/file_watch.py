"""Files a running service reads again when they change: renewed TLS certificates (`tls_reload`), a rotated API
key file (`gateway.auth.ApiKeyFile`).

In Kubernetes both are mounted Secrets, whose files the kubelet swaps in place when the Secret changes; a service
that read them once at start kept a certificate until it expired and a revoked key until it restarted. A
`FileWatch` looks at the files' stamps (a `stat` each, no read) and loads them again only when one changed. A new
version that does not load (a key that is not its certificate's, a half-written file, an emptied key file) is
refused with one WARNING, and what was taken before stays in use until a version that loads appears; the same
contents written again are no change.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from specdec.errors import ConfigError

log = logging.getLogger(__name__)

T = TypeVar("T")
RACY_S = 1.0  # files written this recently are read again at each look (see `FileWatch._racy`)


def files_stamp(paths: Sequence[str]) -> tuple:
    """What identifies the files' current contents without reading them (a Secret's swap gives new inodes)."""
    stamps = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError as exc:
            stamps.append(("missing", exc.errno))
        else:
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))  # ctime: a chmod that mends
    return tuple(stamps)


class FileWatch(Generic[T]):
    """`taken`: what `load()` made of the files, first at construction (its ConfigError is a start-up error);
    `changed()`: a new value once the files changed into one that loads."""

    def __init__(self, paths: Sequence[str], load: Callable[[], T], what: str,
                 accept: Callable[[T, T], None] | None = None) -> None:
        """`load` reads the files and raises ConfigError when they cannot be used; `accept(new, taken)` raises
        ConfigError where a new value that loads must still not replace the one in use; `what` names them in the
        log ("the TLS files of the server")."""
        self.paths, self.load, self.what, self.accept = tuple(paths), load, what, accept
        self._stamp = files_stamp(self.paths)
        self._refused: tuple | None = None  # the stamp of a version already refused (one WARNING each)
        self.taken: T = load()

    def changed(self) -> T | None:
        """The files' new value when they changed since the last look and load into something new; else None."""
        stamp = files_stamp(self.paths)
        if (stamp == self._stamp or stamp == self._refused) and not self._racy(stamp):
            return None
        try:
            value = self.load()
            if self.accept is not None and value != self.taken:
                self.accept(value, self.taken)
        except Exception as exc:  # noqa: BLE001 - whatever the new version is, the one in use stays
            if stamp != self._refused:
                why = exc if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
                log.warning("%s changed but cannot be used (%s); still using what was read before", self.what, why)
            self._refused = stamp
            return None
        if files_stamp(self.paths) != stamp:  # written again while they were read: the next look takes them
            return None
        self._stamp, self._refused = stamp, None
        if value == self.taken:
            return None
        self.taken = value
        log.info("%s changed: now using the new version (%s)", self.what, ", ".join(self.paths))
        return value

    @staticmethod
    def _racy(stamp: tuple) -> bool:
        """A file written within `RACY_S`: a second write of the same size in the same clock tick of the file
        system (a few ms) leaves its stamp as it was, so until then the stamp alone does not tell (as git's "racy"
        index entries)."""
        newest = max((s[2] for s in stamp if s[0] != "missing"), default=0)
        return time.time_ns() - newest < RACY_S * 1e9
