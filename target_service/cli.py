"""`specdec serve-target`: the target model service."""

from __future__ import annotations

DEFAULT_PORT = 50052
# above the draft's own timeout for a target call (60 s), so a draft that waits out a slow call still finds its
# requests; a draft names each running request in every step's Verify
DEFAULT_REQUEST_IDLE_S = 120.0


def register(subparsers) -> None:
    from specdec.rpc.tls import add_tls_args
    from specdec.serving.engine_args import add_engine_args, port, seconds
    from specdec.telemetry.args import add_telemetry_args

    p = subparsers.add_parser(
        "serve-target", help="serve the target model (Prefill / Verify / Release / Generate)",
        description="The target service: verifies draft token trees and decodes plainly (the fallback).",
    )
    p.add_argument("--model", help="target checkpoint directory (HF Llama format, safetensors)")
    p.add_argument("--request-idle-seconds", type=seconds("never"), default=DEFAULT_REQUEST_IDLE_S,
                   help="release a request that no Prefill or Verify has named for this long: its draft is gone "
                        "(killed, or gave up on a call that timed out); 0 = never "
                        f"(default {DEFAULT_REQUEST_IDLE_S:g})")
    p.add_argument("--verify-lane-port", type=port(), default=None, metavar="PORT",
                   help="also serve Verify on a plain TCP port (the verify lane, docs/protocol.md): a draft of this "
                        "target uses it for its per-step calls, ~1 ms a step less than gRPC on a GPU host; same "
                        "calls, same statuses; plaintext only (refused with --tls-cert); 0 = any free port "
                        "(default: no lane)")
    add_engine_args(p, DEFAULT_PORT)
    add_tls_args(p)
    add_telemetry_args(p)
    p.set_defaults(handler=main)


def main(args) -> int:
    from specdec.rpc.cli_support import run_cli_service
    from target_service.app import serve

    return run_cli_service(args, serve)
