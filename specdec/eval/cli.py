"""`specdec accept-eval`: argument parsing and output; the work is in accept_eval.py."""

from __future__ import annotations

import argparse
import json
import sys

from specdec.serving.engine_args import ranged


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculation")
    g.add_argument("--num-steps", type=int, default=5, help="draft steps per proposal (tree depth), default 5")
    g.add_argument("--topk", type=int, default=1, help="children kept per draft step; 1 = a chain, default 1")
    g.add_argument("--num-draft-tokens", type=int, default=5,
                   help="draft tokens per tree after pruning by draft probability, default 5")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "accept-eval", help="measure tau, losslessness and speed of speculative vs plain decoding (in-process)",
        description="Runs speculative and plain decoding on a prompt file and prints one JSON object.",
    )
    p.add_argument("--target", required=True, help="target checkpoint directory (HF Llama format)")
    p.add_argument("--draft", required=True, help="EAGLE-1 or EAGLE-3 head directory")
    p.add_argument("--prompts", required=True, help='JSONL file of {"prompt": ...} lines')
    p.add_argument("--limit", type=ranged(int, 1, what="prompts"), default=None,
                   help="use the first N prompts (N >= 1)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=ranged(int, 1, what="tokens"), default=256,
                   help="keep the last N prompt tokens (N >= 1), default 256")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (checked token for token)")
    p.add_argument("--batch-size", type=ranged(int, 1, what="requests"), default=1,
                   help="requests decoded together (N >= 1), default 1")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto = float32 on CPU, bfloat16 on GPU")
    p.add_argument("--attention-backend", default="torch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print only the JSON object (default prints it indented)")
    p.add_argument("--token-map", metavar="FILE", help="EAGLE-1 heads: the draft's vocabulary (see serve-draft)")
    add_spec_args(p)
    p.set_defaults(handler=run)


def run(args) -> int:
    from specdec.errors import SpecdecError

    try:
        return _run(args)
    except SpecdecError as exc:  # a bad flag or file: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from specdec.engine.factory import EngineOptions, build_draft, build_target
    from specdec.eval.accept_eval import EvalSettings, read_prompts, run_accept_eval, spec_from_args
    from specdec.tokenizer import load_tokenizer

    texts = read_prompts(args.prompts, args.limit)  # a bad file fails before the models load
    opts = EngineOptions(device=args.device, dtype=args.dtype, attention_backend=args.attention_backend,
                         max_batch_size=max(1, args.batch_size), token_map=args.token_map or "")
    target = build_target(args.target, opts)
    draft = build_draft(args.draft, args.target, spec_from_args(args), opts, target.max_context)
    tok = load_tokenizer(args.target)
    prompts = [tok.encode(p)[-args.max_prompt_tokens :] for p in texts]
    settings = EvalSettings(args.max_new_tokens, args.max_prompt_tokens, args.temperature, args.batch_size,
                            args.seed)
    result = run_accept_eval(target, draft, prompts, settings)
    json.dump(result, sys.stdout, indent=None if args.json else 2)
    sys.stdout.write("\n")
    return 0
