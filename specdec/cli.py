"""The `specdec` command line: one subcommand per user-facing task.

Each package contributes its subcommands through a module with `register(subparsers)`; registration is cheap
(argparse only) and every handler imports its heavy dependencies (torch, grpc) when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
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


# `specdec up`'s options whose value is itself a string of flags (`--target-args '--disable-cuda-graph'`): argparse
# takes a lone value that starts with "-" for an option of its own ("expected one argument", QA), so such a value
# is attached to its option (`--target-args=--disable-cuda-graph`) before parsing.
FLAGS_VALUED = ("--target-args", "--draft-args", "--gateway-args")


def attach_flag_values(argv: list[str]) -> list[str]:
    if not argv or argv[0] != "up":
        return argv
    out, i = [], 0
    while i < len(argv):
        if argv[i] in FLAGS_VALUED and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        if argv[i] == "--":  # what follows is positional
            return out + argv[i:]
        out.append(argv[i])
        i += 1
    return out


def _parser_of(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(attach_flag_values(sys.argv[1:] if argv is None else argv))
    if unknown:  # told by the subcommand's own parser: its usage, not the top level's (QA)
        _parser_of(parser, getattr(args, "command", None)).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader of the output left (`| head`): quietly (QA: a traceback from tokenize)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at interpreter exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
