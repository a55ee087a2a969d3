"""`specdec serve-target`: the target model service."""

from __future__ import annotations

DEFAULT_PORT = 50052
# above the draft's own timeout for a target call (60 s), so a draft that waits out a slow call still finds its
# requests; a draft names each running request in every step's Verify
DEFAULT_REQUEST_IDLE_S = 120.0


def register(subparsers) -> None:
    from specdec.rpc.tls import add_tls_args
    from specdec.serving.engine_args import add_engine_args, seconds
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
    add_engine_args(p, DEFAULT_PORT)
    add_tls_args(p)
    add_telemetry_args(p)
    p.set_defaults(handler=main)


def main(args) -> int:
    from specdec.rpc.cli_support import run_cli_service
    from target_service.app import serve

    return run_cli_service(args, serve)
