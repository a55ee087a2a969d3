"""Fallback and routing over fake pairs: a failing draft or target never interrupts the client's stream."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import grpc
import pytest
from conftest import SCRIPT_TEXT
from gateway_fakes import (
    FakeModel,
    PairAddress,
    collect,
    fake_stack,
    gateway_over,
    run,
    start_fake_pair,
    until_speculative,
)

from gateway.interceptors import MetricsInterceptor
from specdec.telemetry import ServiceMetrics
from specdec.v1 import common_pb2, gateway_pb2


def request(**kwargs) -> gateway_pb2.GatewayServiceGenerateRequest:
    return gateway_pb2.GatewayServiceGenerateRequest(
        prompt="def fib(n):", sampling=common_pb2.SamplingParams(max_new_tokens=100), **kwargs
    )


def test_gateway_draft_failing_mid_stream_continues_on_the_target(fake_model, model_dir, caplog):
    metrics = ServiceMetrics("gateway", model_name="target", families=MetricsInterceptor.FAMILIES)

    async def body():
        async with fake_stack(fake_model, model_dir, metrics=metrics) as (pairs, gateway, stub):
            pairs[0].draft.fail_after_chunks = 2
            result = await collect(stub.Generate(request(request_id="r1")))
            await asyncio.sleep(0.1)  # the Release of the draft's request runs in the background
            return pairs, gateway, result

    with caplog.at_level(logging.INFO, logger="gateway.access"):
        pairs, gateway, (text, ids, final, count) = run(body())
    assert text == SCRIPT_TEXT and ids == fake_model.script  # one stream, same text, no token twice
    assert not final.speculative and final.completion_tokens == len(fake_model.script) and final.fallbacks == 1
    # said where operators look: the access log line and the gateway's counter
    (line,) = [r for r in caplog.records if r.getMessage().startswith("/specdec.v1.GatewayService/Generate OK")]
    assert line.getMessage().endswith(", 1 fallback") and line.fallbacks == 1
    assert metrics.registry.get_sample_value("specdec:request_fallbacks_total",
                                             {"service": "gateway", "model_name": "target"}) == 1
    ((rid, prompt, max_new),) = pairs[0].target.seen.requests
    assert rid == "r1~1" and max_new == 100 - 6  # continued after the 2 chunks of 3 tokens already sent
    assert prompt[-6:] == fake_model.script[:6]
    assert pairs[0].target.seen.released == ["r1"]
    assert not gateway.router.pairs[0].draft_up  # taken out until a health check finds it again


def test_a_stream_a_stopping_draft_cancels_continues_on_the_target(fake_model, model_dir):
    """A grpc server that stops cancels the calls it has taken and not yet handed to a handler: a draft stream opened
    in the last moments of the draft's drain ends with CANCELLED. That is the draft failing (the gateway's own cancel
    raises asyncio's CancelledError, never this status), so the request goes on on the target; before, the client
    got the CANCELLED (QA: a rolling restart under load)."""

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            pairs[0].draft.fail_after_chunks = 1
            pairs[0].draft.fail_code, pairs[0].draft.fail_details = grpc.StatusCode.CANCELLED, "CANCELLED"
            return await collect(stub.Generate(request(request_id="r1")))

    text, ids, final, _ = run(body())
    assert text == SCRIPT_TEXT and ids == fake_model.script and final.fallbacks == 1


def test_a_draft_failing_for_its_target_moves_the_stream_to_another_pair(fake_model, model_dir):
    """The draft says its target failed it ("target: ...": stalled, away): the stream moves to the other pair at
    once, through its draft, not onto the same target (QA: two fallbacks for one stalled target), and the draft
    stays in."""
    async def body():
        async with fake_stack(fake_model, model_dir, num_pairs=2) as (pairs, gateway, stub):
            gateway.router.pairs[1].in_flight = 5  # make pair 0 the least loaded
            pairs[0].draft.fail_after_chunks = 2
            pairs[0].draft.fail_details = ("target: the target at t:1 does not answer (target: the target's engine "
                                           "thread has been in one step for over 30 s (--engine-stall-seconds): it "
                                           "is stalled; retry on another replica)")
            result = await collect(stub.Generate(request(request_id="t1")))
            return pairs, gateway, result

    pairs, gateway, (text, _, final, _) = run(body())
    assert text == SCRIPT_TEXT and final.fallbacks == 1 and not final.speculative  # (any fallback: gateway.proto)
    assert not pairs[0].target.seen.requests  # not onto the stalled target
    assert [r[0] for r in pairs[1].draft.seen.requests] == ["t1~1"] and not pairs[1].target.seen.requests
    assert gateway.router.pairs[0].draft_up and not gateway.router.pairs[0].target_up


def test_a_colocated_pair_cut_under_its_draft_stream_moves_to_another_pair(fake_model, model_dir, caplog):
    """Draft and target at one address (`--target in-process`): a draft stream cut UNAVAILABLE means the process
    serving both is going; the stream moves to the other pair at once (one fallback), not onto that target; a
    pair without a draft continues it plainly. The log names the process, not its target (QA)."""
    caplog.set_level(logging.WARNING, logger="gateway.fallback")
    from gateway_fakes import FakeDraft, FakeTarget, gateway_over

    from specdec.rpc.server import start_server
    from specdec.v1 import draft_pb2_grpc, target_pb2_grpc

    async def body():
        target, draft = FakeTarget(fake_model), FakeDraft(fake_model)
        both = await start_server([lambda s: target_pb2_grpc.add_TargetServiceServicer_to_server(target, s),
                                   lambda s: draft_pb2_grpc.add_DraftServiceServicer_to_server(draft, s)],
                                  ["specdec.v1.TargetService", "specdec.v1.DraftService"], "127.0.0.1", 0)
        await both.set_serving(True)
        other = await start_fake_pair(fake_model)
        addr = f"127.0.0.1:{both.bound_port}"
        try:
            plain = PairAddress(None, other.address.target)  # a pair without a draft
            async with gateway_over([PairAddress(addr, addr), plain], model_dir) as (gateway, stub):
                await until_speculative(gateway, [0])
                gateway.router.pairs[1].in_flight = 5  # make the colocated pair the least loaded
                draft.fail_after_chunks, draft.fail_details = 2, "Socket closed"
                result = await collect(stub.Generate(request(request_id="c1")))
        finally:
            for handle in (both, other.draft_handle, other.target_handle):
                await handle.stop(None)
        return target, other, result

    target, other, (text, _, final, _) = run(body())
    assert text == SCRIPT_TEXT and final.fallbacks == 1 and not final.speculative
    assert not target.seen.requests and [r[0] for r in other.target.seen.requests] == ["c1~1"]
    said = [r.getMessage() for r in caplog.records if r.name == "gateway.fallback"]
    assert len(said) == 1 and said[0].startswith("process of pair 0 (") and "continuing on pair 1" in said[0]


def test_an_abort_call_on_the_draft_ends_the_stream_and_keeps_the_draft_in(fake_model, model_dir):
    """A draft's stream that ends with FINISH_REASON_ABORT was named by an Abort call (an operator's): the client's
    stream ends there with finish reason abort; it is not continued on the target, and the draft is not marked down
    (before, one aborted request took a healthy draft out of routing until its next health check, QA)."""

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, gateway, stub):
            pairs[0].draft.abort_after_chunks = 2
            result = await collect(stub.Generate(request(request_id="r1")))
            return pairs, gateway, result

    pairs, gateway, (text, ids, final, _) = run(body())
    assert ids == fake_model.script[:6] and final.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert final.fallbacks == 0 and final.completion_tokens == 6
    assert not pairs[0].target.seen.requests and gateway.router.pairs[0].draft_up


def _own_suffix(rid: str, base: str) -> bool:
    """`base~<8 hex>`: the suffix a stream takes after a collision downstream (`DownstreamIds.claim_unique`)."""
    return re.fullmatch(re.escape(base) + r"~[0-9a-f]{8}", rid) is not None


def test_a_continuation_id_a_client_runs_under_already_takes_one_of_its_own(fake_model, model_dir):
    """A client may name a request `r1~1` itself: request r1's continuation on the target, refused there as r1~1,
    then goes under a random suffix (not r1~2: another gateway's stream of r1 would take that one next too)."""
    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            pairs[0].draft.fail_after_chunks = 2
            pairs[0].target.taken_ids = {"r1~1"}
            result = await collect(stub.Generate(request(request_id="r1")))
            return pairs, result

    pairs, (text, ids, final, _) = run(body())
    assert text == SCRIPT_TEXT and ids == fake_model.script
    (seen,) = [r[0] for r in pairs[0].target.seen.requests]  # (refused ids abort before they are seen)
    assert _own_suffix(seen, "r1") and pairs[0].target.seen.refused == ["r1~1"]


def test_a_clients_own_id_running_elsewhere_runs_under_a_suffix_of_its_own(fake_model, model_dir):
    """A client's id names its request in logs and traces; it is not a uniqueness key. One that another gateway's
    stream already runs under on the pair (ALREADY_EXISTS) goes under a random suffix of its own; the client's
    stats keep t9 (QA: it was the client's ALREADY_EXISTS, prefixed `target: `); past `MAX_ID_TRIES` ids found
    taken it is the client's error."""
    from gateway.fallback import MAX_ID_TRIES

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            pairs[0].target.taken_ids = {"t9"}
            ran = await collect(stub.Generate(request(request_id="t9", no_speculation=True)))
            seen = [r[0] for r in pairs[0].target.seen.requests]
            pairs[0].target.taken_prefixes = ("u1",)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub.Generate(request(request_id="u1", no_speculation=True)))
            return seen, ran, err.value, pairs[0].target.seen.refused

    seen, (text, ids, final, _), err, refused = run(body())
    assert text == SCRIPT_TEXT and final.request_id == "t9"
    assert len(seen) == 1 and _own_suffix(seen[0], "t9")
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS
    assert len([r for r in refused if r.startswith("u1")]) == MAX_ID_TRIES + 1


def test_an_id_whose_release_is_on_its_way_stays_held_until_it_lands(fake_model, model_dir):
    """After a draft failure the target is told to release the draft's id in the background; until that lands the
    id stays the stream's, even once the stream ended, so no new stream under the same client id takes it and has
    its own request released by the late Release (review)."""
    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, gateway, stub):
            pairs[0].draft.fail_after_chunks = 2
            pairs[0].target.release_delay_s = 1.0
            await collect(stub.Generate(request(request_id="r5")))
            held_at_end = set(gateway.servicer._ids._held)
            for _ in range(100):
                if pairs[0].target.seen.released:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.05)
            return held_at_end, set(gateway.servicer._ids._held), pairs[0].target.seen.released

    held_at_end, held_later, released = run(body())
    assert held_at_end == {"r5"} and released == ["r5"] and held_later == set()


@pytest.mark.parametrize("speculative", [True, False])
def test_requests_sharing_one_client_id_run_side_by_side(fake_model, model_dir, speculative):
    """Several requests under one client id at once (a proxy's trace id, a client's job name) all run, each under
    its own downstream id and without waiting out the services' 1 s duplicate grace; each client sees its own
    text and the id it sent (QA: the second was ALREADY_EXISTS after ~1 s)."""
    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, gateway, stub):
            pairs[0].draft.delay_s = pairs[0].target.delay_s = 0.01
            results = await asyncio.gather(*(
                collect(stub.Generate(request(request_id="job-7", no_speculation=not speculative)))
                for _ in range(4)))
            part = pairs[0].draft if speculative else pairs[0].target
            return results, [r[0] for r in part.seen.requests], part.seen.refused, len(gateway.servicer._ids)

    results, downstream, refused, held = run(body())
    assert [(r[0], r[2].request_id) for r in results] == [(SCRIPT_TEXT, "job-7")] * 4
    assert sorted(downstream) == ["job-7", "job-7~1", "job-7~2", "job-7~3"]
    assert refused == [] and held == 0  # no id was tried twice downstream, and none is held after


def test_gateway_draft_server_killed_mid_stream_gives_the_same_text(fake_model, model_dir):
    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, _, stub):
            pairs[0].draft.hang_after_chunks = 1
            call = stub.Generate(request())
            first = await call.read()
            await pairs[0].draft_handle.stop(None)  # the draft process dies with the stream open
            text, _, final, _ = await collect(call)
            return first.text + text, final

    text, final = run(body())
    assert text == SCRIPT_TEXT and final.finish_reason == common_pb2.FINISH_REASON_STOP


def test_gateway_draft_down_at_start_serves_from_the_target(fake_model, model_dir):
    async def body():
        pair = await start_fake_pair(fake_model)
        await pair.draft_handle.stop(None)
        try:
            async with gateway_over([pair.address], model_dir) as (_, stub):
                return await collect(stub.Generate(request()))
        finally:
            await pair.target_handle.stop(None)

    text, _, final, _ = run(body())
    assert text == SCRIPT_TEXT and not final.speculative


def test_gateway_target_failing_mid_stream_continues_on_another_pair(fake_model, model_dir):
    async def body():
        async with fake_stack(fake_model, model_dir, num_pairs=2) as (pairs, gateway, stub):
            pairs[0].target.fail_after_chunks = 3
            gateway.router.pairs[1].in_flight = 5  # make pair 0 the least loaded
            result = await collect(stub.Generate(request(no_speculation=True, request_id="t1")))
            return pairs, result

    pairs, (text, _, final, _) = run(body())
    assert text == SCRIPT_TEXT
    assert [r[0] for r in pairs[0].target.seen.requests] == ["t1"]
    assert [r[0] for r in pairs[1].target.seen.requests][0] == "t1~1"


def test_a_stream_survives_any_number_of_faults_with_tokens_between_them(fake_model, model_dir):
    """Every attempt on either target fails after 4 tokens: a stream that makes progress between faults goes on to
    its end with the same text, however many faults that takes; attempts failing in a row with no token between
    them stay bounded (2 x pairs + 1), and the error says the last failure. Before, the bound counted the stream's
    whole life: a long stream died on its third separate fault, 12 s apart, with a healthy pair up (QA)."""
    async def body():
        async with fake_stack(fake_model, model_dir, num_pairs=2) as (pairs, gateway, stub):
            for pair in pairs:
                pair.target.fail_after_chunks = 4
            survived = await collect(stub.Generate(request(no_speculation=True, request_id="many")))
            attempts = sum(len(p.target.seen.requests) for p in pairs)
            for pair in pairs:
                pair.target.fail_after_chunks = 0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub.Generate(request(no_speculation=True, request_id="none")))
            in_a_row = sum(1 for p in pairs for r in p.target.seen.requests if r[0].startswith("none"))
            return survived, attempts, err.value, in_a_row

    (text, _, final, _), attempts, error, in_a_row = run(body())
    assert text == SCRIPT_TEXT and attempts > 5  # more faults than the old whole-life bound of 5 attempts
    assert final.finish_reason == common_pb2.FINISH_REASON_STOP
    assert error.code() == grpc.StatusCode.UNAVAILABLE and in_a_row == 5
    assert "5 attempts in a row" in error.details() and "fake service went away" in error.details()


def test_gateway_routes_to_the_least_loaded_pair_and_keeps_a_request_on_it(fake_model, model_dir):
    async def body():
        async with fake_stack(fake_model, model_dir, num_pairs=2) as (pairs, gateway, stub):
            for pair in pairs:
                pair.draft.hang_after_chunks = 1
            calls = [stub.Generate(request(request_id=f"h{i}")) for i in range(2)]
            for call in calls:
                await call.read()
            loads = [p.in_flight for p in gateway.router.pairs]
            for call in calls:
                call.cancel()
            await asyncio.sleep(0.2)
            return pairs, loads, [p.in_flight for p in gateway.router.pairs]

    pairs, loads, after = run(body())
    assert loads == [1, 1] and after == [0, 0]
    assert {r[0] for p in pairs for r in p.draft.seen.requests} == {"h0", "h1"}
    assert all(len(p.draft.seen.requests) == 1 for p in pairs)


def test_gateway_unavailable_when_no_pair_is_up(model_dir):
    async def body():
        import grpc

        from gateway.config import GatewayConfig
        from gateway.serve import start_gateway

        config = GatewayConfig(model_dir=model_dir, pairs=(PairAddress(None, "127.0.0.1:9"),), health_interval_s=0.1,
                               pair_wait_s=0.5)
        gateway = await start_gateway(config)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
                from grpc_health.v1 import health_pb2, health_pb2_grpc

                from specdec.v1 import gateway_pb2_grpc

                health = health_pb2_grpc.HealthStub(channel)
                statuses = [(await health.Check(health_pb2.HealthCheckRequest(service=name))).status
                            for name in ("specdec.v1.GatewayService", "", "liveness")]
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                t0 = time.monotonic()
                try:
                    await collect(stub.Generate(request()))
                except grpc.aio.AioRpcError as exc:
                    return exc.code(), exc.details(), statuses, time.monotonic() - t0
        finally:
            await gateway.stop(None)

    code, details, statuses, waited = run(body())
    # after waiting --pair-wait-seconds for a pair to come up
    assert code.name == "UNAVAILABLE" and "no draft/target pair is available in 0.5 s" in details
    assert 0.5 <= waited < 3
    # not ready without a pair, yet alive: a Kubernetes liveness / startup probe on "liveness" does not restart a
    # gateway whose pairs are still loading
    from grpc_health.v1 import health_pb2

    assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING] * 2 + [health_pb2.HealthCheckResponse.SERVING]


def test_gateway_pair_comes_back_after_a_health_check(fake_model, model_dir):
    async def body():
        async with fake_stack(fake_model, model_dir) as (_, gateway, stub):
            pair = gateway.router.pairs[0]
            gateway.router.report_failure(pair, pair_part("draft"), "test")
            assert not pair.speculative
            for _ in range(50):
                await asyncio.sleep(0.05)
                if pair.speculative:
                    break
            return pair.speculative, await collect(stub.Generate(request()))

    back, (_, _, final, _) = run(body())
    assert back and final.speculative


def pair_part(name: str):
    from gateway.router import Part

    return Part(name)


def test_fake_model_is_deterministic_across_continuations():
    model = FakeModel([5, 6, 7, 2])
    sampling = common_pb2.SamplingParams(max_new_tokens=10)
    assert model.plan("a", [1, 1], sampling) == ([5, 6, 7, 2], common_pb2.FINISH_REASON_STOP)
    assert model.plan("a~1", [1, 1, 5, 6], sampling) == ([7, 2], common_pb2.FINISH_REASON_STOP)


def test_an_unanswered_health_check_keeps_a_pair_up_until_several_in_a_row(fake_model, model_dir, monkeypatch):
    """A busy service misses a health check now and then (its event loop waits behind a long step on a small
    CPU): one or two unanswered checks leave its part up (new requests keep their pair), MISSED_CHECKS_DOWN in a
    row mark it down, and a refused connection (a dead service) marks it down at once."""
    from gateway import router as router_module
    from gateway.downstream import Health, HealthCheck

    async def body():
        async with fake_stack(fake_model, model_dir) as (pairs, gateway, stub):
            router = gateway.router
            pair = router.pairs[0]
            [t.cancel() for t in router._health_tasks]  # the background loops off: the checks below are the only ones
            answers = []

            async def probe(timeout_s=1.0):
                return HealthCheck(answers.pop(0))

            monkeypatch.setattr(pair.target, "probe", probe)
            serving = HealthCheck(Health.SERVING)
            monkeypatch.setattr(pair.draft, "probe", lambda timeout_s=1.0: asyncio.sleep(0, serving))
            seen = []
            for health in [Health.NO_ANSWER] * (router_module.MISSED_CHECKS_DOWN - 1):
                answers.append(health)
                await router.check_once()
                seen.append(pair.target_up)
            _, _, final, _ = await collect(stub.Generate(request()))
            answers.append(Health.SERVING)  # answered again: the count starts over
            await router.check_once()
            for _ in range(router_module.MISSED_CHECKS_DOWN):
                answers.append(Health.NO_ANSWER)
                await router.check_once()
            down_after_misses = not pair.target_up
            answers += [Health.SERVING, Health.NOT_SERVING]
            await router.check_once()
            back = pair.target_up
            await router.check_once()
            return seen, final, down_after_misses, back, pair.target_up

    seen, final, down_after_misses, back, up_after_refusal = run(body())
    assert all(seen) and final.finish_reason == common_pb2.FINISH_REASON_STOP
    assert down_after_misses and back and not up_after_refusal


def _frozen(monkeypatch, client) -> None:
    """`client`'s service stops answering health checks (a frozen process: SIGSTOP, a stuck host)."""
    from gateway.downstream import Health, HealthCheck

    monkeypatch.setattr(client, "probe", lambda timeout_s=1.0: asyncio.sleep(0, HealthCheck(Health.NO_ANSWER)))


async def _stream_hanging_on_pair_0(pairs, gateway, stub, rid: str):
    """A speculative stream on pair 0 whose draft stops producing after 2 chunks: (the call, its first message)."""
    gateway.router.pairs[1].in_flight = 5  # make pair 0 the least loaded
    pairs[0].draft.hang_after_chunks = 2
    call = stub.Generate(request(request_id=rid))
    return call, await call.read()


@pytest.mark.parametrize("frozen", ["draft", "target"])
def test_a_stream_on_a_part_that_stops_answering_moves_on(fake_model, model_dir, monkeypatch, frozen):
    """A part freezes under a speculative stream: the stream stops and so do the part's health checks. Once they
    mark it down the stream leaves it with the same text: off a frozen draft to the pair's target, off a pair
    whose target froze to the other pair. Before, it waited as long as a draft's freeze lasted, and for the
    draft's 60 s call timeout under a frozen target."""
    async def body():
        async with fake_stack(fake_model, model_dir, num_pairs=2) as (pairs, gateway, stub):
            call, first = await _stream_hanging_on_pair_0(pairs, gateway, stub, "h1")
            _frozen(monkeypatch, getattr(gateway.router.pairs[0], frozen))
            t0 = time.monotonic()
            text, _, final, _ = await collect(call)
            return first.text + text, final, time.monotonic() - t0, pairs

    text, final, waited, pairs = run(body())
    assert text == SCRIPT_TEXT
    assert waited < 5
    if frozen == "draft":  # on to its pair's target, plainly
        assert [r[0] for r in pairs[0].target.seen.requests] == ["h1~1"] and not final.speculative
    else:  # on to the other pair, through its draft
        assert [r[0] for r in pairs[1].draft.seen.requests] == ["h1~1"] and not final.speculative
        assert not pairs[0].target.seen.requests


@pytest.mark.parametrize("stalled", ["draft", "target"])
def test_a_stream_on_a_part_that_says_its_engine_stalled_moves_on_at_the_next_check(fake_model, model_dir, stalled,
                                                                                   caplog):
    """A part answers UNKNOWN (its engine thread stuck in one step: `StallWatch`): one such check marks it down and
    its streams move on, with no unanswered checks to wait for; SERVING again brings it back."""
    from grpc_health.v1 import health_pb2

    from gateway.router import Part

    part = Part.DRAFT if stalled == "draft" else Part.TARGET

    async def body():
        async with fake_stack(fake_model, model_dir, num_pairs=2) as (pairs, gateway, stub):
            call, first = await _stream_hanging_on_pair_0(pairs, gateway, stub, "s1")
            handle = getattr(pairs[0], f"{stalled}_handle")
            await handle.set_status(health_pb2.HealthCheckResponse.UNKNOWN)
            t0 = time.monotonic()
            text, _, final, _ = await collect(call)
            waited = time.monotonic() - t0
            down = not gateway.router.pairs[0].is_up(part)
            await handle.set_serving(True)
            t1 = time.monotonic()
            while not gateway.router.pairs[0].is_up(part):
                assert time.monotonic() - t1 < 5, "the part did not come back"
                await asyncio.sleep(0.05)
            return first.text + text, final, waited, down, pairs

    text, final, waited, down, pairs = run(body())
    assert text == SCRIPT_TEXT
    # (said in full if it fails: seen once in a full-suite run, not reproduced in 10 runs beside a CPU load)
    assert down, [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.name.startswith("gateway")]
    assert waited < 1.5, waited  # one health interval (0.2 s) and a check, not three unanswered ones
    moved_to = pairs[0].target if stalled == "draft" else pairs[1].draft
    assert [r[0] for r in moved_to.seen.requests] == ["s1~1"] and not final.speculative
    assert any("stalled (it answered UNKNOWN" in r.getMessage() for r in caplog.records)


def test_the_documented_time_to_leave_a_frozen_part_follows_from_the_health_loop():
    """docs/gateway.md's bound (it said ~1-4 s; QA saw a 5.0 s gap): MISSED_CHECKS_DOWN unanswered checks, each
    waiting its deadline, FAST_POLL_S apart, the first up to one health interval after the freeze."""
    import dataclasses
    import inspect

    from repo_paths import REPO

    from gateway.config import GatewayConfig
    from gateway.downstream import DraftClient
    from gateway.router import FAST_POLL_S, MISSED_CHECKS_DOWN

    deadline_s = inspect.signature(DraftClient.probe).parameters["timeout_s"].default
    interval_s = {f.name: f.default for f in dataclasses.fields(GatewayConfig)}["health_interval_s"]
    soonest = MISSED_CHECKS_DOWN * deadline_s + (MISSED_CHECKS_DOWN - 1) * FAST_POLL_S
    doc = " ".join((REPO / "docs" / "gateway.md").read_text().split())
    assert f"{soonest:g}-{soonest + interval_s:g} s after it" in doc


def test_leaving_a_hung_part_cancels_only_the_read_and_keeps_a_real_cancel():
    """`_unless_hung`: a part marked unresponsive during a read ends the read (the downstream generator is closed)
    with PartHung; one marked between reads is seen at the next read; a cancel of the task from elsewhere (the
    client left) stays a cancel, also when a part goes down at the same moment."""
    from gateway.fallback import PartHung, _unless_hung
    from gateway.router import Part

    async def downstream(log, first_hangs: bool = False):
        try:
            yield 1
            if first_hangs:
                await asyncio.sleep(3600)
            yield 2
            await asyncio.sleep(3600)
        finally:
            log.append("closed")

    async def read_all(events, log, on_first=None):
        got = []
        async for chunk in _unless_hung(downstream(log), events):
            got.append(chunk)
            if on_first is not None and len(got) == 1:
                on_first()
        return got

    async def scenario(kind):
        events, log = {Part.DRAFT: asyncio.Event(), Part.TARGET: asyncio.Event()}, []
        on_first = events[Part.TARGET].set if kind == "between" else None
        task = asyncio.ensure_future(read_all(events, log, on_first))
        await asyncio.sleep(0.05)  # now waiting in a read
        if kind in ("during", "both"):
            events[Part.DRAFT].set()
        if kind in ("cancel", "both"):
            task.cancel()
        try:
            return await task, log
        except (PartHung, asyncio.CancelledError) as exc:
            return (type(exc).__name__, getattr(exc, "part", None)), log

    for kind, want in [("during", ("PartHung", Part.DRAFT)), ("between", ("PartHung", Part.TARGET)),
                       ("cancel", ("CancelledError", None)), ("both", ("CancelledError", None))]:
        result, log = run(scenario(kind))
        assert result == want, kind
        assert kind == "between" or log == ["closed"], kind  # the downstream read was cancelled and closed


def test_a_stream_whose_only_pair_restarts_waits_for_it_and_goes_on(fake_model, model_dir):
    """One pair, and its target stalls under a speculative stream (then restarts: NOT_SERVING, SERVING): with no other
    pair up the stream waits for the pair to come back (`--pair-wait-seconds`) and goes on through its draft, the
    same text in one stream. Before, it ended UNAVAILABLE `no draft/target pair is available`."""
    from grpc_health.v1 import health_pb2

    async def body():
        async with fake_stack(fake_model, model_dir, pair_wait_s=10) as (pairs, gateway, stub):
            pairs[0].draft.hang_after_chunks = 2
            call = stub.Generate(request(request_id="w1"))
            first = await call.read()
            await pairs[0].target_handle.set_status(health_pb2.HealthCheckResponse.UNKNOWN)  # stalled
            while gateway.router.pairs[0].target_up:
                await asyncio.sleep(0.02)
            pairs[0].draft.hang_after_chunks = None
            await pairs[0].target_handle.set_status(health_pb2.HealthCheckResponse.NOT_SERVING)  # restarting
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            await pairs[0].target_handle.set_serving(True)
            text, _, final, _ = await collect(call)
            return first.text + text, final, time.monotonic() - t0, pairs

    text, final, after_back, pairs = run(body())
    assert text == SCRIPT_TEXT and final.fallbacks == 1 and not final.speculative and final.tau == 0
    assert [r[0] for r in pairs[0].draft.seen.requests] == ["w1", "w1~1"]  # on through its draft
    assert after_back < 2  # taken up at the pair's next health check


def test_a_new_request_waits_for_a_pair_to_come_up(fake_model, model_dir):
    """No pair up when a request arrives: it waits for one (here its target turns SERVING 0.5 s later) instead of
    UNAVAILABLE at once; within the client's deadline: one shorter than the wait ends it at that deadline."""
    import grpc
    from grpc_health.v1 import health_pb2

    async def body():
        async with fake_stack(fake_model, model_dir, pair_wait_s=10) as (pairs, gateway, stub):
            await pairs[0].target_handle.set_status(health_pb2.HealthCheckResponse.NOT_SERVING)
            while gateway.router.pairs[0].target_up:
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            try:
                await collect(stub.Generate(request(), timeout=0.4))
                short = None
            except grpc.aio.AioRpcError as exc:
                short = exc.code(), time.monotonic() - t0
            t0 = time.monotonic()
            call = stub.Generate(request())
            await asyncio.sleep(0.5)
            await pairs[0].target_handle.set_serving(True)
            text, _, final, _ = await collect(call)
            return short, text, final, time.monotonic() - t0

    short, text, final, waited = run(body())
    assert short is not None and short[0].name in ("DEADLINE_EXCEEDED", "UNAVAILABLE") and short[1] < 2
    assert text == SCRIPT_TEXT and final.speculative and final.fallbacks == 0
    assert 0.5 <= waited < 3


@pytest.mark.parametrize("draft_back", [True, False])
def test_after_waiting_for_a_pair_a_speculative_request_gives_its_draft_a_moment(fake_model, model_dir, monkeypatch,
                                                                                  draft_back):
    """A pair back from a restart: its target answers first, its draft a check or two later (a draft reports
    NOT_SERVING until it has seen its target again). A speculative request that waited for the pair waits up to
    `DRAFT_GRACE_S` more for the draft and then runs through it (before, it ran to its end on the target alone: 1 of
    2 streams in QA); a draft that stays down costs it that grace, then it runs plainly."""
    from grpc_health.v1 import health_pb2

    import gateway.router as router_module

    monkeypatch.setattr(router_module, "DRAFT_GRACE_S", 1.0)
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    async def body():
        async with fake_stack(fake_model, model_dir, pair_wait_s=10) as (pairs, gateway, stub):
            for handle in (pairs[0].target_handle, pairs[0].draft_handle):
                await handle.set_status(not_serving)
            while gateway.router.pairs[0].target_up or gateway.router.pairs[0].draft_up:
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            call = asyncio.ensure_future(collect(stub.Generate(request())))
            await asyncio.sleep(0.3)
            await pairs[0].target_handle.set_serving(True)
            await asyncio.sleep(0.3)
            if draft_back:
                await pairs[0].draft_handle.set_serving(True)
            text, _, final, _ = await call
            return text, final, time.monotonic() - t0

    text, final, waited = run(body())
    assert text == SCRIPT_TEXT and final.speculative == draft_back and final.fallbacks == 0
    assert (0.6 <= waited < 1.3) if draft_back else (1.3 <= waited < 2.5), waited
