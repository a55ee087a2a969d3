"""`specdec tokenize` and `specdec detokenize`: inspect how a model's tokenizer sees text."""

from __future__ import annotations

import argparse
import json
import sys

from specdec.errors import SpecdecError

ALLOW_SPECIAL_CHOICES = ("none", "default", "all")


def register(subparsers: argparse._SubParsersAction) -> None:
    tokenize = subparsers.add_parser(
        "tokenize",
        help="print the token ids of TEXT as JSON",
        description="Print the token ids of TEXT as JSON.",
    )
    _add_tokenizer_flag(tokenize)
    tokenize.add_argument("text", metavar="TEXT", help="text to encode ('-' reads stdin)")
    tokenize.add_argument(
        "--allow-special",
        choices=ALLOW_SPECIAL_CHOICES,
        default="default",
        help="which special-token strings in TEXT become special ids: none, the file's "
        "default_allowed_special (default), or all",
    )
    tokenize.add_argument(
        "--chat", action="store_true", help="encode TEXT as one user message of the chat template"
    )
    tokenize.set_defaults(handler=run_tokenize)

    detokenize = subparsers.add_parser(
        "detokenize", help="print the text of token IDS", description="Print the text of token IDS."
    )
    _add_tokenizer_flag(detokenize)
    detokenize.add_argument("ids", metavar="IDS",
                            help="ids as a JSON list or separated by spaces/commas ('-' reads stdin)")
    detokenize.set_defaults(handler=run_detokenize)


def _add_tokenizer_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer", required=True, metavar="PATH", help="model dir or tokenizer file")


def run_tokenize(args: argparse.Namespace) -> int:
    from specdec.tokenizer import load_tokenizer

    text = text_arg(args.text)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        if args.chat:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        else:
            ids = tokenizer.encode(
                text, allowed_special=None if args.allow_special == "none" else args.allow_special
            )
    except SpecdecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(ids))
    return 0


def run_detokenize(args: argparse.Namespace) -> int:
    from specdec.tokenizer import load_tokenizer

    try:
        ids = parse_ids(text_arg(args.ids))
        text = load_tokenizer(args.tokenizer).decode(ids)
    except (SpecdecError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(text + "\n")
    return 0


def text_arg(value: str) -> str:
    """A text argument, or stdin's for `-`: its bytes read as UTF-8, any that are not as U+FFFD (Python's own
    reading kept them as lone surrogates, which `specdec generate` then failed to send: `UnicodeEncodeError`, QA).
    An argument's bytes are read the same way (before, a bad byte was refused there and replaced on stdin, QA)."""
    if value != "-":
        try:  # (Python decodes argv with surrogateescape: a byte that is not UTF-8 is a lone surrogate)
            return value.encode("utf-8", "surrogateescape").decode("utf-8", errors="replace")
        except UnicodeEncodeError:  # a surrogate no argv byte makes (a caller's own string): as it is
            return value
    raw = getattr(sys.stdin, "buffer", None)  # (a text stream without one, as tests give, is read as it is)
    return sys.stdin.read() if raw is None else raw.read().decode("utf-8", errors="replace")


def parse_ids(raw: str) -> list[int]:
    """`"[1, 2, 3]"`, `"1 2 3"` or `"1,2,3"` -> [1, 2, 3]."""
    raw = raw.strip()
    values = _json_ids(raw) if raw.startswith("[") else raw.replace(",", " ").split()
    # (a JSON true is an int to Python: it read as id 1, QA)
    if not all((isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, str) and v.lstrip("-").isdigit())
               for v in values):
        raise ValueError(f"IDS must be integers, got {raw!r}")
    return [int(v) for v in values]


def _json_ids(raw: str) -> list:
    """IDS that start with `[`, read as JSON (json's own message named no flag and no expected form)."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        found = repr(raw[exc.pos : exc.pos + 20]) if exc.pos < len(raw) else "the end"  # (IDS may be long: stdin)
        raise ValueError(f"IDS is not a JSON list of token ids such as [1, 2, 3]: {exc.msg} at character "
                         f"{exc.pos + 1}, found {found}") from exc
