"""The draft's link to its target stops carrying data without breaking (a network partition, a frozen proxy): the
draft's target watch finds the target unanswered, and the calls still waiting for it end at once (NotReady), so
the running requests fail UNAVAILABLE and a gateway moves them on. Before, they waited for their call's 60 s
deadline (QA: streams stalled 61 s; a client with a 30 s deadline got DEADLINE_EXCEEDED instead of a fallback)."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from reliability_support import (
    DRAFT_HEALTH,
    PROMPT_IDS,
    SERVING,
    draft_kv,
    health,
    start_draft,
    start_target,
    target_kv,
    wait_whole,
)

from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc


class FreezableProxy:
    """A TCP relay to `upstream` whose traffic stops (connections kept open, nothing forwarded) while `frozen`."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream, self.frozen = upstream, threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                while self.frozen.is_set():
                    time.sleep(0.05)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def partitioned():
    target = start_target()
    proxy = FreezableProxy(("127.0.0.1", target.port))
    draft = start_draft(f"127.0.0.1:{proxy.port}")
    yield target, proxy, draft
    proxy.frozen.clear()
    for service in (draft, target):
        service.stop()
    proxy.close()


def stream(draft_addr: str, rid: str, n: int = 400):
    channel = grpc.insecure_channel(draft_addr)
    sampling = common_pb2.SamplingParams(max_new_tokens=n, ignore_eos=True)
    request = draft_pb2.DraftServiceGenerateRequest(request_id=rid, prompt_ids=PROMPT_IDS, sampling=sampling)
    return draft_pb2_grpc.DraftServiceStub(channel).Generate(request, timeout=90), channel


def test_reliability_a_cut_link_to_the_target_ends_the_drafts_requests_in_seconds(partitioned):
    target, proxy, draft = partitioned
    call, channel = stream(draft.addr, "cut")
    it = iter(call)
    next(it)
    proxy.frozen.set()
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in it:
            pass
    ended_in = time.monotonic() - t0
    channel.close()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert "does not answer" in err.value.details()
    assert ended_in < 20, ended_in  # the watch: ~2 s to its next look, two unanswered looks of 5 s; was 60 s
    assert health(draft.addr, DRAFT_HEALTH) != SERVING
    assert wait_whole(draft_kv, draft.addr)[2] == 0  # nothing left running on the draft

    proxy.frozen.clear()  # the link carries data again: the draft is back, and serves
    deadline = time.monotonic() + 30
    while health(draft.addr, DRAFT_HEALTH) != SERVING:
        assert time.monotonic() < deadline, "the draft never came back after the link did"
        time.sleep(0.2)
    call, channel = stream(draft.addr, "after", n=16)
    assert list(call)[-1].HasField("final")
    channel.close()
    # the cut request's state on the target, which lived through the cut, is released once the link is back (it was
    # held until the target's idle sweep, 120 s)
    free, total, running = wait_whole(target_kv, target.addr, timeout_s=10)
    assert free == total and running == 0, (free, total, running)
    print(f"cut link: the draft's request ended after {ended_in:.1f} s")
