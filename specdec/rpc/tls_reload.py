"""TLS files that change while a service runs.

cert-manager renews a certificate well before it expires and the kubelet swaps the mounted Secret's files in place;
a service that read its PEM files once at start presented the old certificate until it expired, and from then on
every new connection failed its handshake (its clients, its probes, its pair). So:

- a server (`ServerCertificates`, the fetcher of `grpc.dynamic_ssl_server_credentials`) looks at its files at every
  handshake and takes a new set that loads; connections already open keep theirs;
- a client (`FileWatch`, asked by the loops that already look at its server every few seconds: the gateway's health
  loop, the draft's target watch) opens a new channel on the new files and retires the old one once its calls are
  done.

A new set that does not load (a key that does not match its certificate, a half-written file) is refused with one
WARNING, and the old one stays in use until a set that loads appears.
"""

from __future__ import annotations

import logging
import os

import grpc

from specdec.errors import ConfigError

log = logging.getLogger(__name__)


def _stamp(paths: tuple[str, ...]) -> tuple:
    """What identifies the files' current contents without reading them (a Secret's swap gives new inodes)."""
    stamps = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError as exc:
            stamps.append(("missing", exc.errno))
        else:
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)


class FileWatch:
    """Tells when a `TlsConfig`'s files hold a new set that loads (`changed`), and which; `taken`: the set in use."""

    def __init__(self, tls, who: str) -> None:
        """`tls`: a `specdec.rpc.tls.TlsConfig`; `who`: names it in the log ("server", "channel to target:50052")."""
        self.tls, self.who = tls, who
        self._paths = tuple(p for p in (tls.cert, tls.key, tls.ca) if p)
        self._stamp = _stamp(self._paths)
        self._refused: tuple | None = None  # the stamp of a set already refused (one WARNING each)
        self.taken = tls.load()  # the contents in use (ConfigError at start; the same bytes again are no change)

    def changed(self):
        """The files' new `TlsMaterial` when they changed since the last set taken and load; else None."""
        stamp = _stamp(self._paths)
        if stamp == self._stamp or stamp == self._refused:
            return None
        try:
            material = self.tls.load()
        except ConfigError as exc:
            self._refused = stamp
            log.warning("TLS files of the %s changed but do not load (%s); still using the ones before", self.who, exc)
            return None
        if _stamp(self._paths) != stamp:  # written again while they were read: the next look takes them
            return None
        self._stamp, self._refused = stamp, None
        if material == self.taken:
            return None
        self.taken = material
        log.info("TLS files of the %s changed: now using the new ones (%s)", self.who, ", ".join(self._paths))
        return material


class ServerCertificates:
    """The certificate fetcher of a server's dynamic credentials: the new files' configuration at the first
    handshake after they changed, else None (no change). It never raises: a failure to look keeps the old set."""

    def __init__(self, tls) -> None:
        self.watch = FileWatch(tls, "server")
        self.initial = self.watch.taken.server_configuration()

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            material = self.watch.changed()
            return None if material is None else material.server_configuration()
        except Exception:  # grpc would fail the handshake; the old certificate is still good
            log.exception("looking at the server's TLS files failed; still using the ones before")
            return None
