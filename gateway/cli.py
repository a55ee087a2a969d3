"""`specdec serve-gateway`, `specdec up` and `specdec generate`.

Registration only builds argparse parsers; each handler imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from gateway.config import DEFAULT_MAX_INPUT_CHARS, DEFAULT_MAX_NEW_TOKENS_LIMIT, DEFAULT_PAIR_WAIT_S
from gateway.local_stack import DEFAULT_DRAFT_DIR, DEFAULT_PORTS, DEFAULT_TARGET_DIR
from specdec.serving.engine_args import address, port, ranged, seconds

DEFAULT_ADDR = f"localhost:{DEFAULT_PORTS['gateway']}"


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_serve(subparsers)
    _register_up(subparsers)
    _register_generate(subparsers)


def _register_serve(subparsers: argparse._SubParsersAction) -> None:
    from specdec.rpc.tls import add_tls_args
    from specdec.telemetry.args import add_telemetry_args

    p = subparsers.add_parser(
        "serve-gateway",
        help="run the gateway (text API) in front of draft/target pairs",
        description="Run the gateway: tokenizes, routes to draft/target pairs and streams text back.",
    )
    p.add_argument("--model", default=str(DEFAULT_TARGET_DIR),
                   help="target model dir (tokenizer, chat template); default: the bundled tiny target")
    p.add_argument(
        "--pair",
        action="append",
        required=True,
        metavar="DRAFT_ADDR=TARGET_ADDR",
        help="a draft/target pair (repeatable); '=TARGET_ADDR' is a target without a draft",
    )
    p.add_argument("--served-model-name", default="", metavar="NAME",
                   help="the model id ListModels reports (default: the target's model directory's name)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=port(), default=DEFAULT_PORTS["gateway"],
                   help="port (0 = any free port; default 50050)")
    p.add_argument("--api-key-file", metavar="FILE", help="accepted API keys, one per line (Bearer auth)")
    p.add_argument("--max-prompt-tokens", type=int, metavar="N", help="longest prompt accepted (default: no limit)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS_LIMIT,
        metavar="N",
        help=f"largest max_new_tokens a request may ask for (default {DEFAULT_MAX_NEW_TOKENS_LIMIT})",
    )
    p.add_argument("--max-concurrent-streams", type=int, metavar="N", help="Generate streams at once (default: any)")
    p.add_argument("--max-streams-per-client", type=int, metavar="N",
                   help="Generate streams at once per client: per API key with --api-key-file, else per peer host "
                        "(default: any)")
    p.add_argument("--max-input-chars", type=int, default=DEFAULT_MAX_INPUT_CHARS, metavar="N",
                   help="longest prompt, chat (its contents) or Tokenize text in characters, refused before "
                        f"tokenizing (default {DEFAULT_MAX_INPUT_CHARS})")
    p.add_argument("--drain-seconds", type=seconds("running streams end at once"), default=30.0,
                   help="on SIGTERM, let streams finish this long (default 30)")
    p.add_argument("--pair-wait-seconds", type=seconds("UNAVAILABLE at once"), default=DEFAULT_PAIR_WAIT_S,
                   help="while no pair is up, a request (a new one, or a stream whose pair failed under it) waits "
                        "this long for one to come up, e.g. its pair restarting, within the client's deadline; then "
                        f"UNAVAILABLE (default {DEFAULT_PAIR_WAIT_S:g})")
    add_tls_args(p, who="the gateway, also used towards its pairs")
    p.add_argument("--tls-client-certs", choices=("required", "optional"), default="required",
                   help="with --tls-ca: whether the gateway's clients must present a certificate (optional: an "
                        "Ingress or clients without one; its pairs are reached with mutual TLS either way)")
    add_telemetry_args(p)
    p.set_defaults(handler=_serve)


def _register_up(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "up",
        help="start target, draft and gateway locally (the bundled tiny model by default)",
        description="Start target, draft and gateway as local processes; Ctrl-C stops all three.",
    )
    p.add_argument("--target", default=str(DEFAULT_TARGET_DIR), help="target model dir")
    p.add_argument("--draft", default=str(DEFAULT_DRAFT_DIR), help="draft (EAGLE head) dir; 'none' for no draft")
    p.add_argument("--device", default="cpu", help="device for target and draft, e.g. cpu, cuda:0 (default cpu)")
    p.add_argument("--host", default="127.0.0.1", help="address the services listen on (default 127.0.0.1)")
    p.add_argument("--colocated", action="store_true",
                   help="run the target inside the draft's process (serve-draft --target in-process: no Verify round "
                        "trip a step; two processes, the draft's port serves both)")
    for service in ("target", "draft"):
        p.add_argument(f"--{service}-args", type=shlex.split, default=[], metavar="FLAGS",
                       help=f"more `specdec serve-{service}` flags, one string, e.g. --{service}-args "
                            "'--engine-stall-seconds 60 --max-batch-size 32' (with --colocated the draft's process "
                            "takes both)")
    p.add_argument("--gateway-args", type=shlex.split, default=[], metavar="FLAGS",
                   help="more `specdec serve-gateway` flags, one string, e.g. --gateway-args '--metrics-port 9100 "
                        "--max-new-tokens 2048'")
    for service, default in DEFAULT_PORTS.items():
        # 1-65535: the other services are told this port, so 0 (any free port) cannot stand for one
        p.add_argument(f"--{service}-port", type=port(zero=None), default=default,
                       help=f"{service} port (default {default})")
    p.add_argument("--verify-lane-port", type=port(), default=0,
                   help="the target's verify lane, a fourth port: Verify over plain TCP (docs/protocol.md); default 0, "
                        "any free port (the draft asks the target which); none with --draft none")
    p.set_defaults(handler=_up)


def _register_generate(subparsers: argparse._SubParsersAction) -> None:
    from specdec.rpc.tls import add_tls_args

    p = subparsers.add_parser(
        "generate",
        help="stream a completion from the gateway (starting a local stack if none is running)",
        description="Stream the completion of PROMPT to stdout and its stats to stderr. Without --addr, uses "
        f"the gateway on {DEFAULT_ADDR}, or starts target, draft and gateway for this one call.",
    )
    p.add_argument("prompt", metavar="PROMPT", help="text to complete ('-' reads stdin)")
    p.add_argument("--addr", type=address(), help=f"gateway address HOST:PORT (default: {DEFAULT_ADDR}, else a local "
                   "stack)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass")
    p.add_argument("--min-p", type=float, help="drop tokens under this fraction of the top probability")
    p.add_argument("--seed", type=int,
                   help="sampling seed: the same text again on the same path (draft, tree shape; docs/gateway.md)")
    p.add_argument("--num-draft-tokens", type=int, metavar="N",
                   help="this request's own smaller tree: at most N draft tokens a step (up to the draft's own)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="send PROMPT as one user message of the chat template")
    p.add_argument("--no-speculation", action="store_true", help="use the target's plain Generate (baseline)")
    p.add_argument("--api-key-file", metavar="FILE", help="file whose first key is sent as Bearer token")
    p.add_argument("--timeout", type=ranged(float, 0.001, what="seconds"), help="deadline of the call in seconds")
    p.add_argument("--device", default="cpu", help="device of an auto-started local stack (default cpu)")
    add_tls_args(p, who="connection to the gateway")
    p.set_defaults(handler=_generate)


def _serve(args: argparse.Namespace) -> int:
    from gateway.serve import main

    return main(args)


def _up(args: argparse.Namespace) -> int:
    from gateway.commands import run_up

    return run_up(args)


def _generate(args: argparse.Namespace) -> int:
    from gateway.commands import run_generate
    from specdec.tokenizer.cli import text_arg

    from_stdin = args.prompt == "-"
    args.prompt = text_arg(args.prompt)
    if args.chat and not args.prompt:  # (a plain empty prompt is refused by the gateway; a chat of one empty
        # message is a valid request, so an empty stdin went out as one and exited 0: QA)
        print(f"error: the chat message is empty{' (stdin gave no text)' if from_stdin else ''}", file=sys.stderr)
        return 2
    return run_generate(args)
