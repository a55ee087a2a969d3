"""Command-line flags shared by the model services (engine options), parsed into EngineOptions."""

from __future__ import annotations

import argparse


def add_engine_args(parser: argparse.ArgumentParser, default_port: int, gpu_plain_steps: int = 4) -> None:
    """`gpu_plain_steps`: the service's --plain-steps default on a GPU (on a CPU it is 4)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all), default 127.0.0.1")
    g.add_argument("--port", type=int, default=default_port, help=f"gRPC port, default {default_port}")
    g.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long running requests may take to finish, default 30")
    g.add_argument("--max-queue-wait-seconds", type=float, default=30.0,
                   help="how long a request may wait for KV pages before RESOURCE_EXHAUSTED (0 = refuse at "
                        "once), default 30")
    default_steps = "4" if gpu_plain_steps == 4 else f"{gpu_plain_steps} on a GPU, 4 on a CPU"
    e = parser.add_argument_group("engine")
    e.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N, default cpu")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = float32 on CPU, bfloat16 on GPU")
    e.add_argument("--attention-backend", default="torch", help="torch (reference, CPU/GPU) or flashinfer (GPU)")
    e.add_argument("--page-size", type=int, default=16, help="tokens per KV page (power of two), default 16")
    e.add_argument("--num-pages", type=int, default=0, help="KV pages in the pool; 0 = size from memory")
    e.add_argument("--max-batch-size", type=int, default=64, help="requests decoded together, default 64")
    e.add_argument("--max-context", type=int, default=0, help="context length; 0 = the model's")
    e.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"],
                   help="dummy = random weights of the checkpoint's shape (benchmarking only)")
    e.add_argument("--config", metavar="NAME", help="with --load-format dummy: a named shape instead of --model "
                   "(llama3-8b, llama3-8b-eagle1, llama3-8b-eagle3)")
    e.add_argument("--simulate-accept-len", type=float, default=0.0,
                   help="BENCHMARKING ONLY (target): accept a simulated number of draft tokens per step with this "
                        "mean tokens/step; outputs are then NOT the model's. Default off")
    e.add_argument("--disable-cuda-graph", action="store_true", help="run the GPU path eagerly (no CUDA graphs)")
    e.add_argument("--plain-steps", type=int, default=None,
                   help="tokens per request a plain decoding step commits (target: Generate; draft: the steps "
                        "--speculation auto decodes plainly), 1-64: one host sync, and through the draft one Verify "
                        f"call, per that many tokens; default {default_steps}; 1 = a token "
                        "per step (tokens stream one by one, new requests join and aborts land after every token)")
    parser.set_defaults(gpu_plain_steps=gpu_plain_steps)


def plain_steps(args: argparse.Namespace) -> int:
    from specdec.engine.plain_steps import MAX_PLAIN_STEPS, PLAIN_STEPS
    from specdec.errors import ConfigError

    steps = args.plain_steps
    if steps is None:
        steps = getattr(args, "gpu_plain_steps", PLAIN_STEPS) if args.device.startswith("cuda") else PLAIN_STEPS
    if not 1 <= steps <= MAX_PLAIN_STEPS:
        raise ConfigError(f"--plain-steps {steps}: between 1 and {MAX_PLAIN_STEPS}")
    return steps


def engine_options(args: argparse.Namespace):
    from specdec.engine.factory import EngineOptions  # torch: imported only when a service starts
    from specdec.errors import ConfigError
    from specdec.models.presets import PRESETS, preset_names

    if args.config:
        if args.load_format != "dummy":
            raise ConfigError("--config NAME gives a shape without weights: it needs --load-format dummy")
        if args.config not in PRESETS:
            raise ConfigError(f"unknown --config {args.config!r}; known: {preset_names()}")
        args.model = args.config
    if not args.model:
        raise ConfigError("--model DIR is required (or --load-format dummy --config NAME)")
    return EngineOptions(
        device=args.device, dtype=args.dtype, attention_backend=args.attention_backend, page_size=args.page_size,
        num_pages=args.num_pages, max_batch_size=args.max_batch_size, max_context=args.max_context,
        dummy_weights=args.load_format == "dummy", simulate_accept_len=getattr(args, "simulate_accept_len", 0.0),
        cuda_graphs=not args.disable_cuda_graph, token_map=getattr(args, "token_map", None) or "",
    ).validate()
