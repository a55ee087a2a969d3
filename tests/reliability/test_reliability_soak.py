"""Soak: thousands of requests through gateway -> draft -> target with random cancels and deadlines, 16 at a
time, on a small KV pool (so admission waits too). Every request ends with a finish or a clear status; at the
end no page is leaked on either service, nothing is left running or waiting, and memory stayed bounded.
"""

from __future__ import annotations

import collections
import random
import resource
import threading
import time

import grpc
import pytest
from reliability_support import draft_kv, start_draft, start_gateway, start_target, target_kv, wait_whole

from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

NUM_REQUESTS = 600
CONCURRENCY = 16
PROMPTS = ["def fib(n):", "class Stack:\n    def push(self, x):\n", "import os\n\n\ndef walk(path):\n", "x = [",
           'def bfs(G, source):\n    """Breadth-first search."""\n']
OUTCOMES: collections.Counter = collections.Counter()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.fixture(scope="module")
def stack():
    target = start_target("--num-pages", "400", "--max-queue-wait-seconds", "5")
    draft = start_draft(target.addr, "--max-queue-wait-seconds", "5")
    gateway = start_gateway(f"{draft.addr}={target.addr}")
    yield target, draft, gateway
    for s in (gateway, draft, target):
        s.stop()


def one_request(stub, rng: random.Random, i: int) -> str:
    action = rng.random()
    sampling = common_pb2.SamplingParams(max_new_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.5)
    if rng.random() < 0.3:
        sampling.temperature, sampling.seed = 0.8, i
    req = gateway_pb2.GatewayServiceGenerateRequest(prompt=rng.choice(PROMPTS), sampling=sampling,
                                                    no_speculation=rng.random() < 0.1, request_id=f"soak-{i}")
    timeout = 0.05 if action < 0.05 else 60  # 5 %: a deadline that passes mid-request
    call = stub.Generate(req, timeout=timeout)
    try:
        for n, msg in enumerate(call):
            if action > 0.85 and n >= rng.randint(0, 2):  # 15 %: the client cancels mid-stream
                call.cancel()
                return "cancelled by the client"
            if msg.HasField("final"):
                return "finished"
        return "ended without a final message"  # would be a lost request
    except grpc.RpcError as exc:
        return exc.code().name


def test_reliability_soak_no_leaks(stack):
    target, draft, gateway = stack
    rng_seed = random.Random(1234)
    seeds = [rng_seed.randrange(1 << 30) for _ in range(NUM_REQUESTS)]
    lock = threading.Lock()
    next_i = iter(range(NUM_REQUESTS))
    rss = []

    def worker(channel):
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            outcome = one_request(stub, random.Random(seeds[i]), i)
            with lock:
                OUTCOMES[outcome] += 1
                if i % 75 == 0:
                    rss.append(rss_mb())

    t0 = time.monotonic()
    with grpc.insecure_channel(gateway.addr) as channel:
        threads = [threading.Thread(target=worker, args=(channel,)) for _ in range(CONCURRENCY)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
    elapsed = time.monotonic() - t0
    print(f"soak: {NUM_REQUESTS} requests in {elapsed:.0f} s: {dict(OUTCOMES)}; RSS MB {[round(r) for r in rss]}")
    assert sum(OUTCOMES.values()) == NUM_REQUESTS
    assert set(OUTCOMES) <= {"finished", "cancelled by the client", "DEADLINE_EXCEEDED", "CANCELLED"}, OUTCOMES
    assert OUTCOMES["finished"] > NUM_REQUESTS * 0.7
    free, total, running = wait_whole(target_kv, target.addr)
    assert (free, running) == (total, 0), "target KV leaked"
    free, total, running = wait_whole(draft_kv, draft.addr)
    assert (free, running) == (total, 0), "draft KV leaked"
    assert rss[-1] - rss[1] < 300, f"memory grew: {rss}"  # after warm-up, bounded
