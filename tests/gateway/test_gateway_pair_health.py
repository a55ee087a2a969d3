"""What the gateway says about its pairs' parts: each part's state at its first health check (one found down:
a WARNING with its address and why), then each change only, and the `specdec:pair_part_up` gauge.

The routers here run no health loop: each test calls `check_once` itself, so it knows every check that ran.
"""

from __future__ import annotations

import asyncio
import logging
import socket

from gateway_fakes import PairAddress, collect, fake_stack, run, serve_fake, start_fake_pair

from gateway.downstream import Health, HealthCheck
from gateway.interceptors import MetricsInterceptor
from gateway.pair_metrics import track_pair_parts
from gateway.router import MISSED_CHECKS_DOWN, Part, Router
from specdec.telemetry import ServiceMetrics
from specdec.v1 import draft_pb2_grpc

ROUTER_LOG = "gateway.router"


def free_port() -> int:
    """A loopback port nothing listens on (connecting to it is refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def router_lines(caplog) -> list[tuple[str, str]]:
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == ROUTER_LOG]


def gauge(metrics: ServiceMetrics, pair: PairAddress, part: str) -> float | None:
    labels = {"service": "gateway", "model_name": "target", "pair": str(pair), "part": part}
    return metrics.registry.get_sample_value("specdec:pair_part_up", labels)


def gateway_metrics() -> ServiceMetrics:
    return ServiceMetrics("gateway", model_name="target", families=MetricsInterceptor.FAMILIES)


async def check_until(router: Router, done, timeout_s: float = 10.0) -> int:
    """Health-check rounds until `done()`; how many ran (a channel that was refused retries after a backoff)."""
    rounds = 0
    while not done():
        assert rounds < timeout_s / 0.05, "the router never saw the expected state"
        await router.check_once()
        rounds += 1
        await asyncio.sleep(0.05)
    return rounds


def test_a_draft_never_up_is_logged_once_with_its_address_and_why_then_once_when_it_comes_up(fake_model, caplog):
    """QA: a gateway whose draft address had nothing on it said nothing about it for 25 s (parts start down and
    only a change of state was logged). Now its first check logs it down, with why; the checks after it that find
    the same say nothing; the check that finds it up logs that once; the gauge follows."""
    caplog.set_level(logging.INFO, logger=ROUTER_LOG)
    draft_port = free_port()
    metrics = gateway_metrics()

    async def body():
        fake = await start_fake_pair(fake_model)  # its target serves; its draft is replaced by the empty port
        addr = PairAddress(f"127.0.0.1:{draft_port}", fake.address.target)
        router = Router.connect([addr], None, health_interval_s=0.2)
        track_pair_parts(metrics, router)
        draft_handle = None
        try:
            for _ in range(5):
                await router.check_once()
            while_down = router_lines(caplog), gauge(metrics, addr, "draft"), gauge(metrics, addr, "target")
            caplog.clear()
            draft_handle = await serve_fake(fake.draft, draft_pb2_grpc.add_DraftServiceServicer_to_server,
                                            "specdec.v1.DraftService", port=draft_port)
            await check_until(router, lambda: router.pairs[0].draft_up)
            came_up = router_lines(caplog)
            caplog.clear()
            for _ in range(5):
                await router.check_once()
            return addr, while_down, came_up, router_lines(caplog), gauge(metrics, addr, "draft")
        finally:
            await router.close()
            for handle in (draft_handle, fake.draft_handle, fake.target_handle):
                if handle is not None:
                    await handle.stop(None)

    addr, (while_down, draft_gauge, target_gauge), came_up, steady, draft_gauge_after = run(body())
    pair = f"pair 0 ({addr})"
    # one line each (the parts are checked at once: in either order); the draft's ends with gRPC's own message
    assert len(while_down) == 2
    target_line = next(line for line in while_down if ": target " in line[1])
    level, draft_line = next(line for line in while_down if ": draft " in line[1])
    assert target_line == ("INFO", f"{pair}: target {addr.target} is up")
    assert level == "WARNING" and draft_line.startswith(f"{pair}: draft {addr.draft} is down: connection refused "
                                                        "(UNAVAILABLE: ")
    assert draft_line.endswith("Connection refused)")
    assert (draft_gauge, target_gauge) == (0.0, 1.0)
    assert came_up == [("INFO", f"{pair}: draft {addr.draft} is up")]
    assert steady == [] and draft_gauge_after == 1.0


def test_a_part_whose_address_is_not_grpc_is_down_as_another_kind_of_server(fake_model, caplog, http1_addr):
    """A pair part at an HTTP/1 port (a metrics port, say): its health check fails with gRPC's "Failed parsing
    HTTP/2"; the router logs it as not speaking gRPC (before: "health check failed" and gRPC's text alone, QA)."""
    caplog.set_level(logging.INFO, logger=ROUTER_LOG)

    async def body():
        fake = await start_fake_pair(fake_model)
        addr = PairAddress(http1_addr, fake.address.target)
        router = Router.connect([addr], None, health_interval_s=0.2)
        try:
            await router.check_once()
            return addr, router.pairs[0].draft_up, router_lines(caplog)
        finally:
            await router.close()
            for handle in (fake.draft_handle, fake.target_handle):
                await handle.stop(None)

    addr, draft_up, lines = run(body())
    assert not draft_up
    level, line = next(line for line in lines if ": draft " in line[1])
    assert level == "WARNING" and line.startswith(f"pair 0 ({addr}): draft {http1_addr} is down: it answered, but "
                                                  "not in gRPC's HTTP/2: it is another kind of server")
    assert "Failed parsing HTTP/2" in line


def test_a_swapped_pair_says_each_address_serves_the_other_kind(fake_model, caplog):
    """QA: `--pair TARGET=DRAFT` (the addresses swapped) gave no router line at all. Each health check names the
    service it expects, and each server answers NOT_FOUND for the other one's name: both parts are logged down,
    once, as not implementing their service."""
    caplog.set_level(logging.INFO, logger=ROUTER_LOG)

    async def body():
        fake = await start_fake_pair(fake_model)
        swapped = PairAddress(fake.address.target, fake.address.draft)
        router = Router.connect([swapped], None, health_interval_s=0.2)
        try:
            for _ in range(5):
                await router.check_once()
            return swapped, router_lines(caplog), router.pairs_up
        finally:
            await router.close()
            await fake.draft_handle.stop(None)
            await fake.target_handle.stop(None)

    swapped, lines, pairs_up = run(body())
    pair = f"pair 0 ({swapped})"
    assert sorted(lines, key=lambda line: ": target " not in line[1]) == [  # the parts are checked at once
        ("WARNING", f"{pair}: target {swapped.target} is down: does not implement specdec.v1.TargetService (its "
                    "health check answered NOT_FOUND: no service 'specdec.v1.TargetService' here; health knows '', "
                    "'specdec.v1.DraftService' ('': the server); --pair is DRAFT=TARGET)"),
        ("WARNING", f"{pair}: draft {swapped.draft} is down: does not implement specdec.v1.DraftService (its health "
                    "check answered NOT_FOUND: no service 'specdec.v1.DraftService' here; health knows '', "
                    "'specdec.v1.TargetService' ('': the server); --pair is DRAFT=TARGET)"),
    ]  # (each server's answer names what it does serve)
    assert pairs_up == 0


def test_a_target_that_is_loading_is_logged_not_serving_once(fake_model, caplog):
    """A target that answers NOT_SERVING (still loading its model) is logged down as not serving at its first
    check, not again while it loads, and up once when it is done."""
    caplog.set_level(logging.INFO, logger=ROUTER_LOG)

    async def body():
        fake = await start_fake_pair(fake_model)
        await fake.target_handle.set_serving(False)
        addr = PairAddress(None, fake.address.target)
        router = Router.connect([addr], None, health_interval_s=0.2)
        try:
            for _ in range(3):
                await router.check_once()
            await fake.target_handle.set_serving(True)
            for _ in range(3):
                await router.check_once()
            return addr, router_lines(caplog)
        finally:
            await router.close()
            await fake.draft_handle.stop(None)
            await fake.target_handle.stop(None)

    addr, lines = run(body())
    assert lines == [
        ("WARNING", f"pair 0 ({addr}): target {addr.target} is down: not serving (it answered NOT_SERVING)"),
        ("INFO", f"pair 0 ({addr}): target {addr.target} is up"),
    ]


def test_a_target_of_another_vocabulary_is_kept_down_until_it_serves_the_gateways_model(fake_model, model_dir,
                                                                                      caplog):
    """A target restarted as another model (a rolling update gone wrong) answers SERVING, but its ids are not the
    gateway tokenizer's: the pair stays down with why, requests go to the other pair (QA: plain requests got
    INVALID_ARGUMENT "token id ... outside the vocabulary" or another model's text with OK), and it comes up once
    it serves the gateway's model again."""
    from specdec.tokenizer import load_tokenizer
    from specdec.v1 import common_pb2, gateway_pb2

    caplog.set_level(logging.INFO, logger=ROUTER_LOG)
    vocab = load_tokenizer(model_dir).model_vocab_size
    assert vocab > 0

    async def body():
        async with fake_stack(fake_model, model_dir, num_pairs=2) as (pairs, gateway, stub):
            wrong = gateway.router.pairs[1]
            pairs[1].target.vocab_size = 2 * vocab
            wrong.target_up = False  # as after its restart: learnt again at its next check
            await check_until(gateway.router, lambda: any("misfit" in m or "vocabulary" in m
                                                          for _, m in router_lines(caplog)))
            assert not wrong.usable and gateway.router.pairs_up == 1
            for _ in range(4):
                await collect(stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(
                    prompt="def f():", no_speculation=True, sampling=common_pb2.SamplingParams(max_new_tokens=3))))
            served_by_wrong = len(pairs[1].target.seen.requests)
            pairs[1].target.vocab_size = vocab
            await check_until(gateway.router, lambda: wrong.usable)
            return wrong, served_by_wrong, router_lines(caplog)

    wrong, served_by_wrong, lines = run(body())
    assert served_by_wrong == 0
    said = [m for level, m in lines if level == "WARNING" and "vocabulary" in m]
    assert said == [f"{wrong}: target {wrong.address.target} is down: it serves fake-target of vocabulary "
                    f"{2 * vocab}, the gateway's --model has {vocab}: not the model this gateway tokenizes for"]


def test_a_target_of_the_same_vocabulary_but_another_depth_is_kept_down(fake_model, model_dir, caplog):
    """Same vocabulary, another model (QA: a 4-layer copy of the tiny target was taken up, and every plain request
    routed there came back as its text with OK): the width and depth of the gateway's --model are checked too."""
    import json
    from pathlib import Path

    from gateway.model_shape import ModelShape

    caplog.set_level(logging.INFO, logger=ROUTER_LOG)
    layers = json.loads((Path(model_dir) / "config.json").read_text())["num_hidden_layers"]
    assert ModelShape.from_dir(model_dir, 0).num_layers == layers

    async def body():
        async with fake_stack(fake_model, model_dir, num_pairs=2) as (pairs, gateway, stub):
            wrong = gateway.router.pairs[1]
            pairs[1].target.num_layers = layers // 2
            wrong.target_up = False  # as after its restart: learnt again at its next check
            await check_until(gateway.router, lambda: any("layers" in m for _, m in router_lines(caplog)))
            assert not wrong.usable and gateway.router.pairs_up == 1
            pairs[1].target.num_layers = layers
            await check_until(gateway.router, lambda: wrong.usable)
            return wrong, router_lines(caplog)

    wrong, lines = run(body())
    said = [m for level, m in lines if level == "WARNING" and "layers" in m]
    assert said == [f"{wrong}: target {wrong.address.target} is down: it serves fake-target of {layers // 2} "
                    f"layers, the gateway's --model has {layers}: not the model this gateway tokenizes for"]


def test_each_change_is_logged_once_and_each_reason_once_while_down(monkeypatch, caplog):
    """Scripted checks of one draft: up; unanswered until marked down (a WARNING: its streams move on); refused
    (a new reason: INFO, once) and unanswered again (said already: nothing) while down; up again; taken out by a
    failed call and found up by the next check (logged, although its last check's state was up too)."""
    caplog.set_level(logging.INFO, logger=ROUTER_LOG)
    refused = HealthCheck(Health.FAILED, "connection refused (UNAVAILABLE: ...)")
    serving, unanswered = HealthCheck(Health.SERVING, "serving"), HealthCheck(Health.NO_ANSWER, "no answer within 1 s")
    script = [serving, serving, *[unanswered] * MISSED_CHECKS_DOWN, refused, refused, unanswered, refused, serving]

    async def body():
        addr = PairAddress("127.0.0.1:1", "127.0.0.1:2")
        router = Router.connect([addr], None, health_interval_s=0.2)
        pair = router.pairs[0]
        draft_checks = list(script)
        monkeypatch.setattr(pair.target, "probe", lambda timeout_s=1.0: asyncio.sleep(0, serving))
        monkeypatch.setattr(pair.draft, "probe", lambda timeout_s=1.0: asyncio.sleep(0, draft_checks.pop(0)))
        monkeypatch.setattr(router, "_learn_target", lambda pair: asyncio.sleep(0))
        monkeypatch.setattr(router, "_learn_draft", lambda pair: asyncio.sleep(0))
        try:
            for _ in script:
                await router.check_once()
            router.report_failure(pair, Part.DRAFT, "UNAVAILABLE: draft went away")
            draft_checks += [serving, serving]
            await router.check_once()
            await router.check_once()
            return router_lines(caplog)
        finally:
            await router.close()

    lines = run(body())
    pair = "pair 0 (127.0.0.1:1=127.0.0.1:2)"
    missed = [("INFO", f"{pair}: draft did not answer a health check ({n} in a row)")
              for n in range(1, MISSED_CHECKS_DOWN)]
    assert lines == [
        ("INFO", f"{pair}: target 127.0.0.1:2 is up"),
        ("INFO", f"{pair}: draft 127.0.0.1:1 is up"),
        *missed,
        ("WARNING", f"{pair}: draft 127.0.0.1:1 is down: no answer within 1 s ({MISSED_CHECKS_DOWN} checks in a row); "
                    "its streams move on"),
        ("INFO", f"{pair}: draft 127.0.0.1:1 is still down: connection refused (UNAVAILABLE: ...)"),
        ("INFO", f"{pair}: draft 127.0.0.1:1 is up"),
        ("WARNING", f"{pair}: draft marked down (UNAVAILABLE: draft went away)"),
        ("INFO", f"{pair}: draft 127.0.0.1:1 is up"),
    ]


def test_the_gateway_exports_each_parts_state(fake_model, model_dir):
    """`start_gateway` with metrics registers the gauge: 1 per part up, a draft taken out by a failed call 0."""
    metrics = gateway_metrics()

    async def body():
        async with fake_stack(fake_model, model_dir, metrics=metrics) as (pairs, gateway, _):
            router, addr = gateway.router, pairs[0].address
            await check_until(router, lambda: router.pairs[0].speculative)
            up = gauge(metrics, addr, "draft"), gauge(metrics, addr, "target")
            [t.cancel() for t in router._health_tasks]  # the background loops off: it would find the draft up again
            router.report_failure(router.pairs[0], Part.DRAFT, "test")
            return up, (gauge(metrics, addr, "draft"), gauge(metrics, addr, "target"))

    up, after_failure = run(body())
    assert up == (1.0, 1.0) and after_failure == (0.0, 1.0)


def test_a_pair_without_a_draft_has_no_draft_series():
    metrics = gateway_metrics()

    async def body():
        router = Router.connect([PairAddress(None, "127.0.0.1:1")], None, health_interval_s=0.2)
        track_pair_parts(metrics, router)
        await router.close()

    run(body())
    assert gauge(metrics, PairAddress(None, "127.0.0.1:1"), "target") == 0.0
    assert gauge(metrics, PairAddress(None, "127.0.0.1:1"), "draft") is None
