"""`specdec serve-draft`: the draft (EAGLE head) service that drives speculation."""

from __future__ import annotations

DEFAULT_PORT = 50051
# the draft's plain steps each pay a Verify round trip (~1.5-2 ms on an H200 host), so on a GPU it asks for more
# tokens per call than the target's own Generate steps (4): through the services the tiny pair's plain decoding at
# 1 request ran at ~0.7x of Generate with 4 per call. On a CPU a forward dwarfs the round trip and 4 already beat
# Generate (docs/benchmarks.md); longer calls would only make auto's first measurements of plain decoding costly
# (3 samples of 16 tokens: most of a short request)
DRAFT_GPU_PLAIN_STEPS = 16


def register(subparsers) -> None:
    from specdec.eval.cli import add_spec_args
    from specdec.rpc.tls import add_tls_args
    from specdec.serving.engine_args import add_engine_args, address, ranged, seconds
    from specdec.telemetry.args import add_telemetry_args

    p = subparsers.add_parser(
        "serve-draft", help="serve an EAGLE draft head that speculates for a target service",
        description="The draft service: proposes token trees, has the target verify them, streams tokens.",
    )
    p.add_argument("--model", help="EAGLE-1 or EAGLE-3 head directory")
    p.add_argument("--target-model", required=True,
                   help="the target's checkpoint directory (the head reads embed_tokens / lm_head from it)")
    p.add_argument("--target", required=True, type=address("in-process"),
                   help="target service address HOST:PORT, or in-process: load --target-model in this process (same "
                        "device and engine flags; --num-pages sizes both KV pools) and serve TargetService on this "
                        "server too, so no step pays a Verify round trip (draft and target on one GPU)")
    p.add_argument("--target-wait-seconds", type=seconds("ask once, no waiting"), default=None,
                   help="how long to wait at start-up for a remote target to be ready, default 600")
    p.add_argument("--request-idle-seconds", type=seconds("never"), default=None,
                   help="with --target in-process: its TargetService releases a request that no call has named for "
                        "this long (other drafts' requests; as serve-target's flag, default 120, 0 = never)")
    add_engine_args(p, DEFAULT_PORT, gpu_plain_steps=DRAFT_GPU_PLAIN_STEPS)
    add_spec_args(p)
    p.add_argument("--speculation", choices=["auto", "always", "off"], default="auto",
                   help="auto (default): per step, verify the whole tree, about half of it, or nothing (plain "
                        "decoding), whichever has measured the most tokens/s at the running batch size (all "
                        "lossless; seeded sampling batches keep the whole tree); always: the whole tree every "
                        "step; off: never speculate: the same service decodes plainly through the target's Verify "
                        "(--plain-steps tokens per call, no features; an A/B baseline or a kill switch)")
    p.add_argument("--calibration-max-batch", type=ranged(int, 0, what="requests", zero="no calibration"),
                   default=None, metavar="N",
                   help="with --speculation auto: before serving, time each budget on throw-away requests at batch "
                        "sizes 1, 2, 4 ... up to N, so the first requests at each batch size need not measure plain "
                        "decoding (at most 30 s in all); default --max-batch-size on a GPU, 1 on a CPU; 0 = none")
    p.add_argument("--feature-wire", choices=["native", "fp8"], default="native",
                   help="how the target sends the features: native (default: its compute dtype) or fp8 (8-bit "
                        "floats with a float32 scale per row: half of bf16's bytes; on the tiny pair tau did not "
                        "change, docs/benchmarks.md); output stays the target's either way")
    p.add_argument("--prompt-feature-mb", type=float, default=64.0, metavar="MB",
                   help="the most feature bytes one admission asks the target for: the prompts admitted together "
                        "share it, each bringing the features of its last MB / (prompts x bytes per token) tokens "
                        "(at least 64 tokens each; the draft skips the earlier ones) - whole prompts of 128 requests "
                        "of an 8B model are ~270 MB and slowed admission ~40%%; default 64, 0 = always whole prompts; "
                        "lossless either way (docs/benchmarks.md, twelfth pass)")
    p.add_argument("--admission-gather-ms", type=float, default=10.0, metavar="MS",
                   help="with no request running, wait for the rest of a burst before admitting: admit once no "
                        "request came for 1 ms, or MS after the first (default 10; 0 = admit at once). A burst "
                        "admitted in waves sizes its first wave's prompt features and plain calls for a small batch")
    p.add_argument("--two-batch-overlap", type=int, default=0, metavar="N",
                   help="from N running requests, split the batch into two micro-batches that take turns, so the "
                        "draft proposes for one while the target verifies the other (pays with draft and target "
                        "on separate GPUs; docs/benchmarks.md has the measured threshold); 0 (default) = off")
    p.add_argument("--plain-calls-in-flight", type=int, default=2, metavar="N",
                   help="while the whole batch decodes plainly (--speculation auto or off), keep N plain calls in "
                        "flight: the next goes out before the previous one's reply, so the target never waits a "
                        "round trip between them (default 2; 1 = one at a time)")
    p.add_argument("--token-map", metavar="FILE",
                   help="EAGLE-1 heads: a JSON file of target token ids, the only tokens the draft proposes (its "
                        "lm_head keeps their rows: a faster draft step with a large vocabulary): "
                        "{\"token_ids\": [...]} as `specdec token-map` writes it, or a bare list [...]. Lossless; "
                        "costs acceptance where the text needs other tokens")
    add_tls_args(p)
    add_tls_args(p, prefix="target-", who="client side, to the target")
    add_telemetry_args(p)
    p.set_defaults(handler=main)


def main(args) -> int:
    from draft_service.app import serve
    from specdec.rpc.cli_support import run_cli_service

    return run_cli_service(args, serve)
