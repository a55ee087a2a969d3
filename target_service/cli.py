"""`specdec serve-target`: the target model service."""

from __future__ import annotations

DEFAULT_PORT = 50052


def register(subparsers) -> None:
    from specdec.rpc.tls import add_tls_args
    from specdec.serving.engine_args import add_engine_args
    from specdec.telemetry.args import add_telemetry_args

    p = subparsers.add_parser(
        "serve-target", help="serve the target model (Prefill / Verify / Release / Generate)",
        description="The target service: verifies draft token trees and decodes plainly (the fallback).",
    )
    p.add_argument("--model", help="target checkpoint directory (HF Llama format, safetensors)")
    add_engine_args(p, DEFAULT_PORT)
    add_tls_args(p)
    add_telemetry_args(p)
    p.set_defaults(handler=main)


def main(args) -> int:
    from specdec.rpc.cli_support import run_cli_service
    from target_service.app import serve

    return run_cli_service(args, serve)
