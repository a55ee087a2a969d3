"""`specdec token-map`: write an EAGLE-1 head's draft vocabulary (`serve-draft --token-map`, `models/token_map.py`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "token-map", help="write a draft vocabulary for an EAGLE-1 head (serve-draft --token-map)",
        description="Write the token ids an EAGLE-1 draft may propose (JSON): the most frequent tokens of a corpus "
                    "under the target's tokenizer, or an EAGLE-3 head's draft vocabulary for the same target.",
    )
    p.add_argument("--out", required=True, metavar="FILE", help="the token-map file to write")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", nargs="+", metavar="PATH",
                     help="text files, or directories searched for --glob; counted with --tokenizer")
    src.add_argument("--from-eagle3", metavar="DIR", help="an EAGLE-3 head: its draft vocabulary (d2t)")
    p.add_argument("--tokenizer", metavar="PATH", help="with --corpus: the target model dir or tokenizer file")
    p.add_argument("--glob", default="*.txt", help="with --corpus: files taken from directories (default *.txt)")
    p.add_argument("--size", type=int, default=32768, help="with --corpus: tokens kept, most frequent first "
                   "(default 32768)")
    p.set_defaults(handler=run)


def _files(paths: list[str], glob: str) -> list[Path]:
    out = []
    for raw in paths:
        path = Path(raw)
        out += sorted(f for f in path.rglob(glob) if f.is_file()) if path.is_dir() else [path]
    return out


def run(args: argparse.Namespace) -> int:
    from specdec.errors import SpecdecError
    from specdec.models.token_map import count_tokens, eagle3_draft_vocab, most_frequent, write_token_map

    try:
        if args.from_eagle3:
            ids = eagle3_draft_vocab(args.from_eagle3)
            print(f"{len(ids)} tokens: the draft vocabulary of {args.from_eagle3}", file=sys.stderr)
        else:
            from specdec.tokenizer import load_tokenizer

            if not args.tokenizer:
                print("error: --corpus needs --tokenizer (the target model dir)", file=sys.stderr)
                return 2
            if args.size < 1:
                print(f"error: --size {args.size}: at least 1", file=sys.stderr)
                return 2
            tokenizer = load_tokenizer(args.tokenizer)
            files = _files(args.corpus, args.glob)
            if not files:
                print(f"error: no files in {' '.join(args.corpus)} (--glob {args.glob})", file=sys.stderr)
                return 2
            texts = (f.read_text(encoding="utf-8", errors="replace") for f in files)
            counts = count_tokens(tokenizer.encode_ordinary, texts)
            if not counts:  # (an empty map was written, and refused by every reader of it: QA)
                print(f"error: --corpus: no tokens in its {len(files)} files", file=sys.stderr)
                return 2
            ids = most_frequent(counts, args.size)
            total = sum(counts.values())
            covered = sum(counts[i] for i in ids)
            print(f"{len(ids)} tokens of {len(counts)} seen cover {100 * covered / max(total, 1):.1f}% of the "
                  f"{total} tokens in {len(files)} files", file=sys.stderr)
        try:
            write_token_map(ids, args.out)
        except OSError as exc:
            print(f"error: --out {args.out}: cannot write it ({exc.strerror or exc})", file=sys.stderr)
            return 2
    except (SpecdecError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
