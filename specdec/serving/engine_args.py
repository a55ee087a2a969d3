"""Command-line flags shared by the model services (engine options), parsed into EngineOptions; and the argparse
types that range-check the services' numeric flags (`port`, `ranged`) while parsing: a value out of range stops
the command at once (exit 2, `argument --flag: ...`) instead of wrapping around or being taken silently."""

from __future__ import annotations

import argparse
import math

from specdec.rpc.address import MAX_PORT, address_problem
from specdec.serving.stall_watch import DEFAULT_STALL_S, MIN_STALL_S

# Prompt tokens of one prefill part (`--prefill-chunk-tokens`, `specdec.engine.prefill_parts`) on a GPU and on a
# CPU: a running stream's longest wait while a long prompt is admitted is one part's forward. CPU, the tiny pair
# through the services, a 1,800-token prompt (`python bench/prefill_parts.py`): the running stream's longest gap
# 1.07 s in one forward, 0.25 s in parts of 512 (the prompt's first token 0.90 s against 1.05).
DEFAULT_PREFILL_CHUNK = 2048
CPU_PREFILL_CHUNK = 512


def ranged(kind: type = float, minimum: float = 0, maximum: float | None = None, *, what: str = "a number",
           zero: str | None = None):
    """An argparse `type`: a finite `kind` (int or float) from `minimum` to `maximum` (None: no upper bound); 0 too
    when `zero` says what it means. The error names the range (`what`) and the meaning of 0:

        ranged(what="seconds", zero="never")("-1")  ->  "-1 is out of range: seconds >= 0 (0 = never)"
        ranged(float, 1, what="tokens per step", zero="off")("0.5")  ->  "... tokens per step >= 1, or 0 = off"
    """
    bounds = f">= {minimum:g}" if maximum is None else f"{minimum:g}-{maximum:g}"
    if zero is not None:
        bounds += f" (0 = {zero})" if minimum <= 0 else f", or 0 = {zero}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") \
                from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if (zero is not None and value == 0) or (minimum <= value and (maximum is None or value <= maximum)):
            return value
        raise argparse.ArgumentTypeError(f"{text} is out of range: {what} {bounds}")

    return parse


def port(zero: str | None = "any free port"):
    """The argparse `type` of a port flag: 0-65535, `zero` saying what 0 means; None: 1-65535 (0 means nothing)."""
    return ranged(int, 0 if zero is not None else 1, MAX_PORT, what="a port", zero=zero)


def address(*words: str):
    """The argparse `type` of an address flag: HOST:PORT with a port 1-65535, or one of `words` (e.g. in-process)."""

    def parse(text: str) -> str:
        problem = None if text in words else address_problem(text)
        if problem:
            raise argparse.ArgumentTypeError(problem + (f" (or {' / '.join(words)})" if words else ""))
        return text

    return parse


def seconds(zero: str | None = None):
    """The argparse `type` of a duration flag: seconds >= 0, `zero` saying what 0 means."""
    return ranged(float, 0, what="seconds", zero=zero)


def add_engine_args(parser: argparse.ArgumentParser, default_port: int, gpu_plain_steps: int = 4) -> None:
    """`gpu_plain_steps`: the service's --plain-steps default on a GPU (on a CPU it is 4)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all), default 127.0.0.1")
    g.add_argument("--port", type=port(), default=default_port,
                   help=f"gRPC port (0 = any free port), default {default_port}")
    g.add_argument("--drain-seconds", type=seconds("running requests end at once"), default=30.0,
                   help="on SIGTERM, how long running requests may take to finish, default 30")
    g.add_argument("--max-queue-wait-seconds", type=seconds("refuse at once"), default=30.0,
                   help="how long a request may wait for KV pages before RESOURCE_EXHAUSTED (0 = refuse at "
                        "once), default 30")
    g.add_argument("--engine-stall-seconds", type=ranged(float, MIN_STALL_S, what="seconds", zero="never"),
                   default=DEFAULT_STALL_S,
                   help="once the engine thread has been in one step (or one batch of calls) this long, health "
                        "reports UNKNOWN under every name, liveness included, and new calls are refused UNAVAILABLE "
                        "until the step ends: the gateway moves the service's streams on, a Kubernetes liveness "
                        f"probe restarts a process that stays stuck; at least {MIN_STALL_S:g}, default "
                        f"{DEFAULT_STALL_S:g}, 0 = never")
    default_steps = "4" if gpu_plain_steps == 4 else f"{gpu_plain_steps} on a GPU, 4 on a CPU"
    e = parser.add_argument_group("engine")
    e.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N, default cpu")
    e.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = float32 on CPU, bfloat16 on GPU")
    e.add_argument("--attention-backend", default="torch", help="torch (reference, CPU/GPU) or flashinfer (GPU)")
    e.add_argument("--page-size", type=int, default=16, help="tokens per KV page (power of two), default 16")
    e.add_argument("--num-pages", type=ranged(int, what="KV pages", zero="size from memory"), default=0,
                   help="KV pages in the pool; 0 = size from memory")
    e.add_argument("--max-batch-size", type=ranged(int, 1, what="requests"), default=64,
                   help="requests decoded together, default 64")
    e.add_argument("--max-context", type=ranged(int, what="tokens", zero="the model's"), default=0,
                   help="context length; 0 = the model's")
    e.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"],
                   help="dummy = random weights of the checkpoint's shape (benchmarking only)")
    e.add_argument("--config", metavar="NAME", help="with --load-format dummy: a named shape instead of --model "
                   "(llama3-8b, llama3-8b-eagle1, llama3-8b-eagle3)")
    e.add_argument("--simulate-accept-len", type=ranged(float, 1, what="tokens per step", zero="off"), default=0.0,
                   help="BENCHMARKING ONLY (target): accept a simulated number of draft tokens per step with this "
                        "mean tokens/step; outputs are then NOT the model's. Default off")
    e.add_argument("--prefill-chunk-tokens", type=ranged(int, 16, what="tokens", zero="never"), default=None,
                   help="target: a prompt longer than this is prefilled in parts of at most this many tokens, and "
                        "the Verify calls of running streams run between two parts (they wait for one part, not "
                        f"the whole prompt); at least 16, default {DEFAULT_PREFILL_CHUNK} on a GPU, "
                        f"{CPU_PREFILL_CHUNK} on a CPU, 0 = every prompt in one forward")
    e.add_argument("--disable-cuda-graph", action="store_true", help="run the GPU path eagerly (no CUDA graphs)")
    e.add_argument("--plain-steps", type=int, default=None,
                   help="tokens per request a plain decoding step commits (target: Generate; draft: the steps "
                        "it decodes plainly, --speculation auto or off), 1-64: one host sync, and through the draft "
                        f"one Verify call, per that many tokens; default {default_steps}; 1 = a token per step "
                        "(tokens stream one by one, new requests join and aborts land after every token)")
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
        prefill_chunk_tokens=prefill_chunk_tokens(args),
    ).validate()


def prefill_chunk_tokens(args: argparse.Namespace) -> int:
    chunk = getattr(args, "prefill_chunk_tokens", None)
    if chunk is None:
        return DEFAULT_PREFILL_CHUNK if args.device.startswith("cuda") else CPU_PREFILL_CHUNK
    return chunk
