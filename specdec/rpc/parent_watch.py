"""A service started by `specdec up` (or `specdec generate`) ends when that process ends, however it ends.

`up` starts each service in a session of its own, so a terminal's Ctrl-C reaches `up` alone and it stops them in
order. A SIGKILL to `up` left them running though, re-parented to init and holding their ports. So `up` names
itself in `EXIT_WITH_PARENT_ENV`, and the service (`exit_with_parent`) polls its parent pid from a daemon thread:
once the parent is gone it sends itself SIGTERM, the usual drain. Polling `getppid()` works on Linux and macOS
alike; prctl(PR_SET_PDEATHSIG) is Linux only and fires when the forking *thread* exits.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

EXIT_WITH_PARENT_ENV = "SPECDEC_EXIT_WITH_PARENT"
POLL_S = 0.5
HARD_EXIT_AFTER_S = 10.0  # past the drain: the engine's stop, the spans' export, a model load that cannot be cut


def child_env() -> dict[str, str]:
    """The environment of a child process that is to end when this one does."""
    return {**os.environ, EXIT_WITH_PARENT_ENV: str(os.getpid())}


def exit_with_parent(drain_s: float) -> None:
    """With `EXIT_WITH_PARENT_ENV` set: SIGTERM to this process once its parent has gone, and a hard exit if the
    drain has not ended it `drain_s` + `HARD_EXIT_AFTER_S` later. The variable is removed: processes this one
    starts have a parent of their own."""
    parent = os.environ.pop(EXIT_WITH_PARENT_ENV, None)
    if parent:
        grace_s = drain_s + HARD_EXIT_AFTER_S
        threading.Thread(target=_watch, args=(int(parent), grace_s), name="exit-with-parent", daemon=True).start()


def _watch(parent: int, grace_s: float) -> None:
    while os.getppid() == parent:  # re-parented (to init or a subreaper) once the parent has died
        time.sleep(POLL_S)
    log.warning("parent process %d is gone: stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    log.error("still running %g s after the parent went: exiting without the rest of the drain", grace_s)
    os._exit(1)  # not `logging.shutdown()` first: a main thread stuck holding a handler's lock would hang it
