"""The `specdec` command line: one subcommand per user-facing task.

Each package contributes its subcommands through a module with `register(subparsers)`; registration is cheap
(argparse only) and every handler imports its heavy dependencies (torch, grpc) when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that contribute subcommands, in the order `--help` lists them.
COMMAND_MODULES = (
    "gateway.cli",
    "target_service.cli",
    "draft_service.cli",
    "specdec.eval.cli",
    "specdec.tokenizer.cli",
    "specdec.models.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec", description="Lossless speculative decoding served as gRPC microservices."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not exc.name or not name.startswith(exc.name):  # a real import error inside the module
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
