"""A real loopback server: health, reflection (via grpcurl), error mapping, cancellation, message limits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.errors import NotReady
from specdec.rpc.channel import make_channel, wait_for_serving
from specdec.rpc.metadata import request_id_metadata
from specdec.rpc.server import LIVENESS
from specdec.v1 import target_pb2, target_pb2_grpc

TARGET = "specdec.v1.TargetService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=20))


async def health_of(channel, name):
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name))
    return reply.status


def test_health_not_serving_until_set_then_serving(fake_server):
    async def body():
        async with fake_server() as (handle, _), make_channel(f"127.0.0.1:{handle.bound_port}") as channel:
            assert await health_of(channel, TARGET) == NOT_SERVING
            assert await health_of(channel, "") == NOT_SERVING
            with pytest.raises(NotReady, match="NOT_SERVING"):
                await wait_for_serving(channel, TARGET, timeout_s=0.3, poll_s=0.05)
            await handle.set_serving(True)
            await wait_for_serving(channel, TARGET, timeout_s=2)
            assert await health_of(channel, "") == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_of(channel, "no.such.Service")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            # the message names the names health knows (the stock servicer's was empty: QA)
            assert "'no.such.Service'" in err.value.details() and repr(TARGET) in err.value.details()

    run(body())


def test_health_list_answers_every_name_as_check_does(fake_server, grpcurl):
    """grpc.health.v1 has List too (reflection describes it); the stock servicer left it unimplemented: the client
    got UNIMPLEMENTED and the server logged a NotImplementedError traceback (QA)."""
    async def body():
        async with fake_server(health_names=[TARGET, LIVENESS]) as (handle, _), \
                make_channel(f"127.0.0.1:{handle.bound_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            listed = (await stub.List(health_pb2.HealthListRequest())).statuses
            assert {name: r.status for name, r in listed.items()} == {"": NOT_SERVING, TARGET: NOT_SERVING,
                                                                      LIVENESS: NOT_SERVING}
            await handle.set_serving(True)
            listed = (await stub.List(health_pb2.HealthListRequest())).statuses
            assert {name: r.status for name, r in listed.items()} == {"": SERVING, TARGET: SERVING, LIVENESS: SERVING}
            proc = await asyncio.create_subprocess_exec(
                grpcurl, "-plaintext", "-d", "{}", f"127.0.0.1:{handle.bound_port}", "grpc.health.v1.Health/List",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await proc.communicate()
            assert proc.returncode == 0, err.decode()
            assert json.loads(out)["statuses"][TARGET]["status"] == "SERVING"

    run(body())


def test_wait_for_serving_times_out_without_a_server():
    async def body():
        async with make_channel("127.0.0.1:1") as channel:
            with pytest.raises(NotReady, match="UNAVAILABLE"):
                await wait_for_serving(channel, TARGET, timeout_s=0.3, poll_s=0.05)

    run(body())


def test_reflection_lists_services_and_serves_descriptors(fake_server, grpcurl):
    async def grpcurl_out(*args):
        proc = await asyncio.create_subprocess_exec(
            grpcurl, "-plaintext", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        return out.decode()

    async def body():
        async with fake_server(health_names=[TARGET, LIVENESS]) as (handle, _):
            await handle.set_serving(True)
            addr = f"127.0.0.1:{handle.bound_port}"
            listed = (await grpcurl_out(addr, "list")).split()
            assert {TARGET, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(
                listed
            )
            # a health-only name is no service: listed, it made `grpcurl describe` fail (QA: Symbol not found)
            assert LIVENESS not in listed
            assert "service TargetService" in await grpcurl_out(addr, "describe")
            described = await grpcurl_out(addr, "describe", TARGET)
            assert "rpc Verify ( .specdec.v1.VerifyRequest )" in described
            assert "repeated int32 parents = 3;" in await grpcurl_out(
                addr, "describe", "specdec.v1.TreeProposal"
            )
            info = json.loads(await grpcurl_out("-d", "{}", addr, f"{TARGET}/GetModelInfo"))
            vocab_size = info.get(
                "vocabSize", info.get("vocab_size")
            )  # json_name depends on the grpcurl build
            assert info["model"] == "fake" and vocab_size == 32, info

    run(body())


@pytest.mark.parametrize(
    ("request_id", "code", "message"),
    [
        ("bad", grpc.StatusCode.INVALID_ARGUMENT, "prompt_ids must not be empty"),
        ("full", grpc.StatusCode.RESOURCE_EXHAUSTED, "KV pool full: need 4 pages, 0 free"),
        ("unknown", grpc.StatusCode.NOT_FOUND, "request 'x' is not running"),
        ("boom", grpc.StatusCode.INTERNAL, "internal error: RuntimeError: engine bug"),
    ],
)
def test_errors_map_to_status_codes_and_the_server_keeps_serving(fake_server, request_id, code, message):
    async def body():
        async with fake_server() as (handle, _), make_channel(f"127.0.0.1:{handle.bound_port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Prefill(target_pb2.PrefillRequest(request_id=request_id, prompt_ids=[1]))
            assert err.value.code() == code
            assert err.value.details() == message
            ok = await stub.Prefill(target_pb2.PrefillRequest(request_id="ok", prompt_ids=[1, 2, 3]))
            assert ok.first_token == 7 and list(ok.features.shape) == [3, 256]

    run(body())


def test_streaming_error_after_some_chunks(fake_server):
    async def body():
        async with fake_server() as (handle, servicer), make_channel(f"127.0.0.1:{handle.bound_port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            received = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for chunk in stub.Generate(
                    target_pb2.TargetServiceGenerateRequest(request_id="midstream")
                ):
                    received.extend(chunk.token_ids)
            assert received == [0, 1]
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            full = [
                t async for c in stub.Generate(target_pb2.TargetServiceGenerateRequest()) for t in c.token_ids
            ]
            assert full == [0, 1, 2]

    run(body())


def test_client_cancel_closes_the_servicer_stream(fake_server):
    async def body():
        async with fake_server() as (handle, servicer), make_channel(f"127.0.0.1:{handle.bound_port}") as ch:
            call = target_pb2_grpc.TargetServiceStub(ch).Generate(
                target_pb2.TargetServiceGenerateRequest(request_id="hang")
            )
            first = await call.read()
            assert list(first.token_ids) == [0]
            call.cancel()
            await asyncio.wait_for(servicer.stream_closed.wait(), timeout=5)

    run(body())


def test_metadata_request_id_and_deadline_reach_the_servicer(fake_server):
    async def body():
        async with fake_server() as (handle, _), make_channel(f"127.0.0.1:{handle.bound_port}") as channel:
            stub = target_pb2_grpc.TargetServiceStub(channel)
            request = target_pb2.TargetServiceGetModelInfoRequest()
            plain = await stub.GetModelInfo(request)
            assert (plain.model, plain.dtype) == ("fake", "none")
            tagged = await stub.GetModelInfo(request, metadata=request_id_metadata("req-42"), timeout=5)
            assert (tagged.model, tagged.dtype) == ("req-42", "deadline")

    run(body())


def test_message_over_the_limit_is_resource_exhausted(fake_server):
    limit = 1 << 20

    async def body():
        async with fake_server(max_message_bytes=limit) as (handle, _):
            addr = f"127.0.0.1:{handle.bound_port}"
            async with make_channel(addr, max_message_bytes=8 * limit) as channel:  # the server refuses
                stub = target_pb2_grpc.TargetServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Release(target_pb2.ReleaseRequest(request_ids=["x" * (2 * limit)]))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                small = await stub.Release(target_pb2.ReleaseRequest(request_ids=["x" * (limit // 2)]))
                assert small.num_released == 0
                # The response (2048 x 256 bf16 = 1 MiB + framing) is over the server's send limit.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Prefill(target_pb2.PrefillRequest(request_id="big", prompt_ids=[1]))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    run(body())


@contextlib.asynccontextmanager
async def _serving_with_stream(fake_server, request_id: str):
    """A SERVING fake target with one Generate stream started under `request_id`, its first chunk read; yields
    (handle, servicer, channel, stub, stream)."""
    async with fake_server() as (handle, servicer), make_channel(f"127.0.0.1:{handle.bound_port}") as ch:
        await handle.set_serving(True)
        stub = target_pb2_grpc.TargetServiceStub(ch)
        stream = stub.Generate(target_pb2.TargetServiceGenerateRequest(request_id=request_id))
        assert list((await stream.read()).token_ids) == [0]
        yield handle, servicer, ch, stub, stream


def test_a_stream_sending_when_the_drain_ends_gets_the_drains_status(fake_server):
    """A stream that is mostly in grpc's send (a chunk as fast as the client reads) when the grace runs out still
    ends with the drain's UNAVAILABLE and message: a cancel at the send would have left it grpc's "Cancelling all
    calls"."""

    async def body():
        for _ in range(3):
            async with _serving_with_stream(fake_server, "flood") as (handle, _, ch, stub, flood):
                stopping = asyncio.ensure_future(handle.stop(grace_s=0.3))
                chunks = 0
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while True:
                        chunk = await flood.read()
                        assert chunk is not grpc.aio.EOF
                        chunks += 1
                await stopping
                assert chunks > 10
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
                assert "drain period (0.3 s) ended" in err.value.details()

    run(body())


def test_a_draining_server_refuses_new_calls_with_unavailable_and_finishes_running_ones(fake_server):
    """From the moment `stop` begins (before the health flip and the server's own stop, both of which await):
    new unary and streaming calls get UNAVAILABLE, health checks still answer, a stream accepted before runs on."""

    async def body():
        async with _serving_with_stream(fake_server, "slow") as (handle, _, ch, stub, running):
            handle.gate.draining = True  # what `stop` sets first
            for call in (lambda: stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest()),
                         lambda: stub.Generate(target_pb2.TargetServiceGenerateRequest()).read()):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "shutting down" in err.value.details()
            assert await health_of(ch, TARGET) == SERVING  # until the flip: load balancers read it
            rest = []
            while (chunk := await running.read()) is not grpc.aio.EOF:
                rest += chunk.token_ids
            assert rest == [1, 2] and await running.code() == grpc.StatusCode.OK
            await handle.stop(grace_s=2)

    run(body())


def test_a_call_arriving_during_the_grace_period_gets_unavailable_and_the_drain_ends_with_the_last_call(fake_server):
    """While `stop(grace)` waits for a running stream, the server still runs: a new call is refused by the gate
    (UNAVAILABLE, retried elsewhere), not cancelled by a stopping grpc server. A stream that outlives the grace is
    cancelled at its end; with nothing running, `stop` does not wait out the grace."""

    async def body():
        async with _serving_with_stream(fake_server, "hang") as (handle, servicer, ch, stub, hanging):
            assert handle.gate.in_flight == 1
            t0 = time.monotonic()
            stopping = asyncio.ensure_future(handle.stop(grace_s=1.5))
            while await health_of(ch, TARGET) == SERVING:
                await asyncio.sleep(0.01)
            for _ in range(5):  # repeatedly through the grace period
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Prefill(target_pb2.PrefillRequest(request_id="late", prompt_ids=[1]), timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
                await asyncio.sleep(0.2)
            assert not stopping.done()
            await stopping
            assert 1.4 < time.monotonic() - t0 < 5
            # ended by the stop with a status a client can act on (was grpc's CANCELLED "Cancelling all calls")
            assert await hanging.code() == grpc.StatusCode.UNAVAILABLE
            assert "drain period (1.5 s) ended before this call did" in await hanging.details()
            assert servicer.stream_closed.is_set() and handle.gate.in_flight == 0

        async with fake_server() as (handle, _), make_channel(f"127.0.0.1:{handle.bound_port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            await handle.set_serving(True)
            assert list((await stub.Generate(target_pb2.TargetServiceGenerateRequest()).read()).token_ids) == [0]
            t0 = time.monotonic()
            await handle.stop(grace_s=30)
            assert time.monotonic() - t0 < 5 and handle.gate.in_flight == 0

    run(body())


def test_clients_that_go_elsewhere_once_refused_never_meet_a_stopping_servers_cancel(fake_server):
    """Clients calling in a loop that leave at their first UNAVAILABLE (as clients that retry elsewhere, or read
    health, do): a drain with nothing in flight stops the grpc server only once their calls stopped arriving
    (`DrainGate.wait_quiet`). Before, it stopped within ~5 ms of the drain's start and 6-7 of 8 such clients had
    their call in grpc's hands then: CANCELLED, which clients do not retry (QA)."""
    import threading

    codes: list[str] = []

    def client(port: int, stop: threading.Event) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            while not stop.is_set():
                try:
                    stub.GetModelInfo(target_pb2.TargetServiceGetModelInfoRequest(), timeout=5)
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)
                    return

    async def body():
        async with fake_server() as (handle, _):
            await handle.set_serving(True)
            stop = threading.Event()
            threads = [threading.Thread(target=client, args=(handle.bound_port, stop)) for _ in range(8)]
            for t in threads:
                t.start()
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            await handle.stop(grace_s=5)
            took = time.monotonic() - t0
            stop.set()
            await asyncio.to_thread(lambda: [t.join() for t in threads])
            return took

    took = run(body())
    assert codes == ["UNAVAILABLE"] * 8, codes
    assert took < 1.5  # the linger ends once calls stop arriving (`QUIET_S`), `LINGER_MAX_S` at most


def test_a_port_in_use_is_named_as_such():
    """A port another process listens on: the start-up error says so (gRPC's own said "Failed to bind ... set
    GRPC_VERBOSITY=debug", QA); an address that is not this machine's is named too."""
    import socket

    from specdec.errors import ConfigError
    from specdec.rpc.server import start_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}: port {port} is already in use"):
            run(start_server([], [TARGET], "127.0.0.1", port))
    with pytest.raises(ConfigError, match="192.0.2.1 is not an address of this machine"):
        run(start_server([], [TARGET], "192.0.2.1", 0))


def test_a_call_cancelled_inside_its_own_abort_keeps_its_status_at_a_drains_end():
    """A drain's end cancels a call whose handler is inside `context.abort` (its status already set): the gate's
    own abort would be a second one, which grpc refuses ("Abort already called!", logged with a traceback, QA).
    The call ends with its handler's status."""
    import asyncio

    import grpc.aio

    from specdec.rpc.drain_gate import DrainGate

    class Context:
        aborts: list = []

        async def abort(self, code, details):
            if self.aborts:
                raise grpc.aio.UsageError("Abort already called!")
            self.aborts.append(code)
            await asyncio.sleep(10)  # the drain's end cancels the call here

    async def main():
        gate = DrainGate()
        context = Context()

        async def call():
            async with gate._running(context):
                await context.abort(grpc.StatusCode.NOT_FOUND, "gone")

        task = asyncio.ensure_future(call())
        await asyncio.sleep(0.05)
        gate.end_running("drain over")
        with pytest.raises(asyncio.CancelledError):
            await task
        assert context.aborts == [grpc.StatusCode.NOT_FOUND] and gate.in_flight == 0

    asyncio.run(main())


def test_a_native_panic_in_a_handler_ends_the_call_internal():
    """A BaseException that is no cancel or exit (pyo3's PanicException, raised by tiktoken) ends the call with
    INTERNAL like any bug; before, the call got no status and waited for its deadline (QA). A cancel passes."""
    import asyncio

    from specdec.rpc.errors import map_errors

    class PanicException(BaseException):
        pass

    class Context:
        code = details = None

        def set_code(self, code):
            self.code = code

        def set_details(self, details):
            self.details = details

    class Servicer:
        @map_errors
        async def Panics(self, request, context):
            raise PanicException("stack overflow")

        @map_errors
        async def Cancelled(self, request, context):
            raise asyncio.CancelledError

    context = Context()
    assert asyncio.run(Servicer().Panics(None, context)) is None
    assert context.code == grpc.StatusCode.INTERNAL and "PanicException: stack overflow" in context.details
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(Servicer().Cancelled(None, Context()))
