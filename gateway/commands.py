"""What `specdec up` and `specdec generate` do (their flags are in `gateway.cli`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time

import grpc

from gateway.client import GatewayClient, GenerationStats
from gateway.local_stack import STOP_SIGNALS, LocalStack, StackConfig, is_gateway_serving, temporary_stack
from specdec.errors import SpecdecError
from specdec.rpc.peer_protocol import not_grpc, not_grpc_text
from specdec.rpc.tls import TlsConfig, handshake_hint

DEFAULT_LOCAL_ADDR = "localhost:50050"


def run_up(args: argparse.Namespace) -> int:
    """Start the three services, print their addresses, restart any that dies (`LocalStack.supervise`) until
    Ctrl-C, SIGTERM or SIGHUP (or one that keeps dying), stop them."""
    config = StackConfig(
        target_dir=args.target,
        draft_dir=None if args.draft.lower() == "none" else args.draft,
        device=args.device,
        host=args.host,
        gateway_port=args.gateway_port,
        draft_port=args.draft_port,
        target_port=args.target_port,
        verify_lane_port=args.verify_lane_port,
        colocated=args.colocated,
        target_args=tuple(args.target_args),
        draft_args=tuple(args.draft_args),
        gateway_args=tuple(args.gateway_args),
    )
    stack = LocalStack(config)
    with sigterm_as_interrupt():
        return _serve_until_stopped(stack)


def _serve_until_stopped(stack: LocalStack) -> int:
    try:
        stack.start()
        for name, addr in stack.addresses().items():
            print(f"{name:8s} {addr}", flush=True)
        print(f'ready: specdec generate --addr {stack.gateway_addr} "def fib(n):"   (Ctrl-C stops)', flush=True)
        while True:
            for note in stack.supervise():
                print(f"specdec up: {note}", file=sys.stderr, flush=True)
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("stopping (Ctrl-C again stops at once)", file=sys.stderr, flush=True)
        return 0
    except SpecdecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        try:
            stack.stop()
        except KeyboardInterrupt:  # the second Ctrl-C: `stop` killed what still ran
            print("stopped at once", file=sys.stderr)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (`kill`, a process manager, a test's timeout) and SIGHUP (a closed terminal, a dropped SSH session)
    raise KeyboardInterrupt, so a local stack stops as on Ctrl-C, in order. By default either ends this process at
    once, and the services, which run in sessions of their own, stop only when their `parent_watch` sees it gone."""

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, interrupt) for s in STOP_SIGNALS if s != signal.SIGINT}  # (SIGINT raises it)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_generate(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as cleanup:
        cleanup.enter_context(sigterm_as_interrupt())  # SIGTERM, SIGHUP as Ctrl-C: exit 130, the request cancelled
        received = False  # any text yet (a closed socket after some is not a refused handshake)
        try:
            addr = args.addr or _local_gateway(args.device, cleanup)
            api_key = _first_key(args.api_key_file) if args.api_key_file else None
            client = cleanup.enter_context(
                GatewayClient(addr, api_key=api_key, tls=TlsConfig.from_args(args), timeout_s=args.timeout)
            )
            stream = client.generate(
                [{"role": "user", "content": args.prompt}] if args.chat else args.prompt,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                min_p=args.min_p,
                seed=args.seed,
                stop=args.stop,
                no_speculation=args.no_speculation,
                spec=None if args.num_draft_tokens is None else {"num_draft_tokens": args.num_draft_tokens},
            )
            for text in stream:
                received = True
                sys.stdout.write(text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            sys.stdout.flush()
        except SpecdecError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except grpc.RpcError as exc:
            print(f"\nerror: {rpc_error_text(exc, args.timeout, connected=received)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: a stack started for this call stops on the way out
            print("\ninterrupted", file=sys.stderr)
            return 130
        except BrokenPipeError:
            # the reader left (`| head`): the request is cancelled on the way out, quietly (QA: a traceback)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
            return 0
    print(format_stats(stream.stats), file=sys.stderr)
    return 0


def rpc_error_text(exc: grpc.RpcError, timeout_s: float | None, connected: bool = False) -> str:
    """A failed call in words. A deadline under --timeout is the request's own: gRPC's text for it ("Stream
    removed (Deadline Exceeded)") named neither the flag nor the time. `connected`: the call had received
    something, so a closed socket is not a handshake refused (QA: a gateway killed mid-stream read as a TLS hint)."""
    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s is not None:
        return f"DEADLINE_EXCEEDED: the request's --timeout of {timeout_s:g} s ran out"
    if not_grpc(exc.code(), exc.details()):
        return f"{exc.code().name}: {not_grpc_text('the gateway address')} ({exc.details()})"
    hint = "" if connected else handshake_hint(exc.code(), exc.details(), "the gateway", "--tls")
    return f"{exc.code().name}: {exc.details()}" + hint


def _local_gateway(device: str, cleanup: contextlib.ExitStack) -> str:
    """The gateway on localhost:50050 if one answers, else a local stack started for this call."""
    if is_gateway_serving(DEFAULT_LOCAL_ADDR):
        return DEFAULT_LOCAL_ADDR
    print(
        f"specdec: no gateway on {DEFAULT_LOCAL_ADDR}; starting target, draft and gateway for this call "
        "(`specdec up` keeps them running)",
        file=sys.stderr,
        flush=True,
    )
    stack: LocalStack = cleanup.enter_context(temporary_stack(StackConfig.free_ports(device=device)))
    return stack.gateway_addr


def _first_key(path: str) -> str:
    from gateway.auth import load_api_keys

    return load_api_keys(path)[0].decode()


def format_stats(stats: GenerationStats | None) -> str:
    if stats is None:
        return "[no final stats: the stream ended early]"
    mode = f"tau {stats.tau:.2f}" if stats.speculative else "no speculation"
    fallbacks = f", {_count(stats.fallbacks, 'fallback')}" if stats.fallbacks else ""
    return (
        f"[{_count(stats.completion_tokens, 'token')} in {stats.total_s:.2f} s, {stats.tokens_per_s:.1f} tokens/s, "
        f"{mode}, first text after {stats.time_to_first_token_s:.2f} s, prompt {_count(stats.prompt_tokens, 'token')}, "
        f"finish {stats.finish_reason}{fallbacks}]"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
