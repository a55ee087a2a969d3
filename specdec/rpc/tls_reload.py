"""TLS files that change while a service runs (`specdec.rpc.file_watch`).

cert-manager renews a certificate well before it expires and the kubelet swaps the mounted Secret's files; a
service that read its PEM files once at start presented the old certificate until it expired, and from then on
every new connection failed its handshake (its clients, its probes, its pair). So:

- a server (`ServerCertificates`, the fetcher of `grpc.dynamic_ssl_server_credentials`) looks at its files at every
  handshake and takes a new set that loads; connections already open keep theirs;
- a client (`tls_watch`, asked by the loops that already look at its server every few seconds: the gateway's health
  loop, the draft's target watch) opens a new channel on the new files and retires the old one once its calls are
  done.
"""

from __future__ import annotations

import logging

import grpc

from specdec.errors import ConfigError
from specdec.rpc.file_watch import FileWatch
from specdec.rpc.tls_check import CLIENT, SERVER, certificate_names, covers

log = logging.getLogger(__name__)


def tls_watch(tls, who: str, role: str = CLIENT) -> FileWatch:
    """A watch over a `specdec.rpc.tls.TlsConfig`'s files whose values are their checked `TlsMaterial` for `role`;
    `who` names the user in the log ("server", "channel to target:50052")."""
    return FileWatch([p for p in (tls.cert, tls.key, tls.ca) if p], lambda: tls.load(role),
                     f"the TLS files of the {who}", accept=_still_serves if role == SERVER else _still_chained)


def _still_serves(new, taken) -> None:
    """A server's renewed certificate must still chain, and still name every host the one in use names: its
    clients verify the name they dial (`localhost`, a pod's DNS name). A valid certificate of the same CA for
    other names was taken, and every client's handshake failed from then on (QA: a gateway's pairs all went down
    within 0.1 s)."""
    _still_chained(new, taken)
    if new.cert is None or taken.cert is None:
        return
    old_names, new_names = certificate_names(taken.cert), certificate_names(new.cert)
    if old_names is None or new_names is None:
        return
    lost = sorted(name for name in old_names if not covers(new_names, name))
    if lost:
        raise ConfigError(f"the new certificate no longer names {', '.join(lost)} (it names "
                          f"{', '.join(sorted(new_names)) or 'nothing'}): clients that reach this service by "
                          "those names would fail its hostname check; the certificate in use stays (a restart "
                          "takes the new one)")


def _still_chained(new, taken) -> None:
    """A certificate that chained to its set's CA bundle must still: a CA bundle changed before (or without) its
    certificates trusts no peer that the old certificates reach, nor do they reach a peer of the new CA (QA)."""
    if taken.chains_to_ca and not new.chains_to_ca:
        raise ConfigError("the certificate no longer chains to the CA bundle (a CA changed without its certificate, "
                          "or the other way round: waiting for the rest)")


class ServerCertificates:
    """The certificate fetcher of a server's dynamic credentials: the new files' configuration at the first
    handshake after they changed, else None (no change). It never raises: a failure to look keeps the old set."""

    def __init__(self, tls) -> None:
        self.watch = tls_watch(tls, "server", SERVER)
        self.initial = self.watch.taken.server_configuration()

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            material = self.watch.changed()
            return None if material is None else material.server_configuration()
        except Exception:  # grpc would fail the handshake; the old certificate is still good
            log.exception("looking at the server's TLS files failed; still using the ones before")
            return None
