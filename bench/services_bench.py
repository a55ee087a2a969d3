"""End-to-end tokens/s and per-step time split of speculative decoding through the gRPC services (tiny pair, CPU).

Starts the target service and one draft service per setting (in this process, each on its own event-loop thread,
or as their own processes with --target-process / --draft-process, as deployed), sends N concurrent greedy
requests (`ignore_eos`, so every request makes the same number of tokens) once to `DraftService.Generate`
(speculative) and once to `TargetService.Generate` (plain), and reports tokens/s, the speed-up, tau and the split
of one speculative step in ms:

    propose        the draft's tree growth
    target queue   a Verify waiting for the target's engine thread (service process only: 0 in this process)
    target verify  the target's batched verify: forward, acceptance, features to host
    target reply   packing the VerifyResponse (service process only)
    RPC rest       the draft's Verify round trip minus the three target columns: the draft's packing and
                   decoding, gRPC, the features' copy to the draft's device (in this process: queue and reply too)
    extend         the draft's extend over the accepted tokens (admission extend over the prompt excluded)

A service in this process is timed by wrapping its engine and scheduler; a service process by scraping its
`specdec:step_phase_seconds` metrics before and after each run.
Speculative output is checked against plain output token for token (`match`); the exit status is 3 when one
differs (never for SIMULATED runs, whose outputs differ by construction).

    python bench/services_bench.py [--concurrency 1,8,32] [--settings eagle1-chain,eagle3-chain,eagle1-tree]
                                   [--new-tokens 64] [--prompt-tokens 256] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

TINY = REPO_ROOT / "models" / "tiny-code"
DEV_PROMPTS = REPO_ROOT.parent / "shared" / "prompts" / "dev.jsonl"
FALLBACK_PROMPTS = [  # used when ../shared/prompts/dev.jsonl is absent
    'def shortest_path_length(G, source, target):\n    """Return the length of the shortest path from source to '
    'target.\n\n    Parameters\n    ----------\n    G : NetworkX graph\n    source : node\n    target : node\n',
    'def is_bipartite(G):\n    """Returns True if graph G is bipartite, False if not.\n\n    Parameters\n    '
    '----------\n    G : NetworkX graph\n\n    Returns\n    -------\n    bool\n',
    'def degree_histogram(G):\n    """Returns a list of the frequency of each degree value.\n\n    Parameters\n    '
    '----------\n    G : Networkx graph\n       A graph\n\n    Returns\n    -------\n    hist : list\n',
    'class Stack:\n    """A last-in first-out container."""\n\n    def __init__(self):\n        self._items = []\n\n'
    '    def push(self, item):\n        """Add item on top."""\n',
]


@dataclass(frozen=True)
class Setting:
    name: str
    draft_dir: str  # under models/tiny-code
    num_steps: int
    topk: int
    num_draft_tokens: int


SETTINGS = {s.name: s for s in [
    Setting("eagle1-chain", "draft", 5, 1, 5),
    Setting("eagle3-chain", "draft-eagle3", 5, 1, 5),
    Setting("eagle1-tree", "draft", 4, 4, 12),
    Setting("eagle3-tree", "draft-eagle3", 4, 4, 12),
]}


# ---- instrumentation (bench-only: wraps, never edits, the engines) ---------------------------------------------
class Probe:
    """Collects the schedulers the services build and times `TargetEngine.verify` on the target."""

    def __init__(self):
        self.schedulers: list = []
        self.target_verify_s = 0.0
        self.target_verify_calls = 0

    def install(self) -> None:
        import draft_service.app
        import target_service.app
        from specdec.engine.scheduler import Scheduler

        probe = self

        class CountingScheduler(Scheduler):
            """Counts decode steps and their batch sizes."""

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.num_steps = self.sum_batch = 0
                probe.schedulers.append(self)

            def _decode(self):
                self.num_steps += 1
                self.sum_batch += len(self.running)
                return super()._decode()

        def build_target_timed(*args, **kwargs):
            engine = build_target(*args, **kwargs)
            verify = engine.verify

            def timed_verify(inputs, **kwargs):
                t0 = time.perf_counter()
                try:
                    return verify(inputs, **kwargs)
                finally:
                    probe.target_verify_s += time.perf_counter() - t0
                    probe.target_verify_calls += 1

            engine.verify = timed_verify
            return engine

        build_target = target_service.app.build_target
        target_service.app.build_target = build_target_timed
        target_service.app.Scheduler = CountingScheduler
        draft_service.app.Scheduler = CountingScheduler

    def snapshot(self, scheduler, target, draft) -> dict:
        """Cumulative step timings: from the draft's scheduler when it runs here, else scraped from the draft
        process's metrics; the target's from the wrapped engine here, else from its process's metrics."""
        snap = dict(propose_s=0.0, verify_s=0.0, extend_s=0.0, admit_s=0.0, num_steps=0, sum_batch=0, target_s=0.0,
                    target_queue_s=0.0, target_reply_s=0.0)
        if scheduler is not None:
            t = scheduler.timings
            snap.update(propose_s=t.propose_s, verify_s=t.verify_s, extend_s=t.extend_s, admit_s=t.admit_s,
                        num_steps=scheduler.num_steps, sum_batch=scheduler.sum_batch)
        elif isinstance(draft, ServiceProcess):
            d = draft.scrape()
            snap.update(propose_s=d.phase_sum("propose"), verify_s=d.phase_sum("verify"),
                        extend_s=d.phase_sum("extend"), admit_s=d.phase_sum("admit"),
                        num_steps=d.phase_count("step"), sum_batch=d.get("specdec:batch_size_sum"))
        if isinstance(target, ServiceProcess):
            t = target.scrape()
            snap.update(target_s=t.phase_sum("forward"), target_queue_s=t.phase_sum("queue"),
                        target_reply_s=t.phase_sum("reply"))
        else:
            snap["target_s"] = self.target_verify_s
        return snap


# ---- services in this process ----------------------------------------------------------------------------------
from service_process import ServiceProcess  # noqa: E402

from specdec.serving.service_thread import ServiceThread  # noqa: E402


def engine_flags(max_concurrency: int, prompt_tokens: int, new_tokens: int) -> list[str]:
    pages = max_concurrency * (math.ceil((prompt_tokens + new_tokens + 65) / 16) + 1) + 16
    return ["--port", "0", "--drain-seconds", "1", "--log-level", "WARNING", "--num-pages", str(pages),
            "--max-batch-size", str(max(max_concurrency, 1))]


def start_target(flags: list[str], own_process: bool = False):
    from target_service.app import serve

    argv = ["serve-target", "--model", str(TINY / "target"), *flags]
    if own_process:
        return ServiceProcess(argv, "specdec.v1.TargetService")
    return ServiceThread(serve, argv).start()


def start_draft(target_addr: str, setting: Setting, flags: list[str], own_process: bool = False):
    from draft_service.app import serve

    argv = ["serve-draft", "--model", str(TINY / setting.draft_dir), "--target-model", str(TINY / "target"),
            "--target", target_addr, "--num-steps", str(setting.num_steps), "--topk", str(setting.topk),
            "--num-draft-tokens", str(setting.num_draft_tokens), "--speculation", "always", *flags]
    if own_process:
        return ServiceProcess(argv, "specdec.v1.DraftService")
    return ServiceThread(serve, argv).start()


# ---- clients ---------------------------------------------------------------------------------------------------
async def _stream(stub_call, request) -> tuple[list[int], object]:
    tokens, last = [], None
    async for msg in stub_call(request):
        tokens += list(msg.token_ids)
        last = msg
    return tokens, last


async def run_batch(addr: str, speculative: bool, prompts: list[list[int]], new_tokens: int, tag: str):
    """All prompts at once; returns (wall seconds, token lists, final messages)."""
    from specdec.rpc.channel import make_channel
    from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

    sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    async with make_channel(addr) as channel:
        if speculative:
            call, make = draft_pb2_grpc.DraftServiceStub(channel).Generate, draft_pb2.DraftServiceGenerateRequest
        else:
            call, make = target_pb2_grpc.TargetServiceStub(channel).Generate, target_pb2.TargetServiceGenerateRequest
        jobs = [_stream(call, make(request_id=f"{tag}-{i}", prompt_ids=p, sampling=sampling))
                for i, p in enumerate(prompts)]
        t0 = time.perf_counter()
        results = await asyncio.gather(*jobs)
        wall = time.perf_counter() - t0
    return wall, [r[0] for r in results], [r[1] for r in results]


# ---- one measurement -------------------------------------------------------------------------------------------
@dataclass
class Row:
    setting: str
    concurrency: int
    spec_tok_s: float
    plain_tok_s: float
    speedup: float
    tau: float
    steps: int
    mean_batch: float
    propose_ms: float
    target_queue_ms: float  # a Verify waiting for the target's engine thread (0: not measured, target in-process)
    target_ms: float
    target_reply_ms: float  # packing the VerifyResponse (0: not measured, target in-process)
    rpc_ms: float
    extend_ms: float
    verify_rtt_ms: float
    admit_s: float  # the draft's admissions over the whole run (Prefill RPCs, the draft's extend over prompts)
    plain_target_ms: float  # plain Generate: target compute per decode step
    match: bool
    gpu_busy: dict | None = None  # GPU index -> busy fraction over the run (--gpu-busy)


def per_step_split(before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in before}
    steps = max(d["num_steps"], 1)
    ms = lambda s: 1000.0 * s / steps  # noqa: E731
    target_side = d["target_s"] + d["target_queue_s"] + d["target_reply_s"]
    return dict(steps=int(d["num_steps"]), mean_batch=d["sum_batch"] / steps, propose_ms=ms(d["propose_s"]),
                target_queue_ms=ms(d["target_queue_s"]), target_ms=ms(d["target_s"]),
                target_reply_ms=ms(d["target_reply_s"]), rpc_ms=ms(d["verify_s"] - target_side),
                extend_ms=ms(d["extend_s"]), verify_rtt_ms=ms(d["verify_s"]), admit_s=d["admit_s"])


BUSY_GPUS: list[int] = []  # --gpu-busy: the GPUs whose busy fraction each speculative run records


def busy_meter():
    if not BUSY_GPUS:
        return contextlib.nullcontext()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_busy import GpuBusy

    return GpuBusy(BUSY_GPUS)


def measure_plain(snapshot, addr: str, prompts, new_tokens: int, repeats: int) -> dict:
    """Best (shortest wall) of `repeats` runs; `snapshot()` reads the cumulative timings (see Probe.snapshot)."""
    best = None
    for _ in range(repeats):
        before = snapshot()
        wall, tokens, _ = asyncio.run(run_batch(addr, False, prompts, new_tokens, f"plain{len(prompts)}"))
        after = snapshot()
        steps = max(after["num_steps"] - before["num_steps"], 1)
        run = dict(tok_s=sum(map(len, tokens)) / wall, tokens=tokens,
                   target_ms=1000.0 * (after["target_s"] - before["target_s"]) / steps)
        best = run if best is None or run["tok_s"] > best["tok_s"] else best
    return best


def measure_spec(snapshot, addr: str, prompts, new_tokens: int, setting: str, plain: dict, repeats: int) -> Row:
    """Best (shortest wall) of `repeats` runs, with that run's step split."""
    best = None
    for _ in range(repeats):
        before = snapshot()
        tag = f"{setting}{len(prompts)}"
        with busy_meter() as busy:
            wall, tokens, finals = asyncio.run(run_batch(addr, True, prompts, new_tokens, tag))
        split = per_step_split(before, snapshot())
        tok_s = sum(map(len, tokens)) / wall
        tau = sum(f.final.tau for f in finals) / len(finals)
        row = Row(setting, len(prompts), tok_s, plain["tok_s"], tok_s / plain["tok_s"], tau, **split,
                  plain_target_ms=plain["target_ms"], match=tokens == plain["tokens"],
                  gpu_busy=getattr(busy, "fractions", None))
        best = row if best is None or row.spec_tok_s > best.spec_tok_s else best
    return best


# ---- driver ----------------------------------------------------------------------------------------------------
def load_prompts(path: Path, num: int, prompt_tokens: int) -> list[list[int]]:
    """The first `num` prompts of `path` (JSONL with "prompt"; the bundled fallback when absent), tokenized."""
    from specdec.tokenizer import load_tokenizer

    tok = load_tokenizer(TINY / "target")
    if path.exists():
        texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]
    else:
        print(f"{path} not found: using {len(FALLBACK_PROMPTS)} bundled prompts", file=sys.stderr)
        texts = FALLBACK_PROMPTS
    return [tok.encode(texts[i % len(texts)])[-prompt_tokens:] for i in range(num)]


def warm_up(addr: str, speculative: bool, prompts, new_tokens: int) -> None:
    asyncio.run(run_batch(addr, speculative, prompts[:2], min(new_tokens, 16), "warm"))


def run(args) -> list[Row]:
    if args.colocated:
        return run_colocated(args)
    probe = Probe()
    probe.install()
    conc = sorted(set(args.concurrency))
    prompts = load_prompts(args.prompts, max(conc), args.prompt_tokens)
    flags = engine_flags(max(conc), args.prompt_tokens, args.new_tokens) + args.engine_flags.split()
    target = start_target(flags + ["--device", args.target_device] + args.target_flags.split(), args.target_process)
    target_sched = None if args.target_process else probe.schedulers[-1]
    rows = []
    try:
        warm_up(target.addr, False, prompts, args.new_tokens)
        plain = {n: measure_plain(lambda: probe.snapshot(target_sched, None, None), target.addr, prompts[:n],
                                  args.new_tokens, args.repeats)
                 for n in conc}
        for name in args.settings:
            setting = SETTINGS[name]
            draft_flags = flags + ["--device", args.draft_device] + args.draft_flags.split()
            t0 = time.perf_counter()
            draft = start_draft(target.addr, setting, draft_flags, args.draft_process)
            print(f"{name}: draft start-up {time.perf_counter() - t0:.1f} s (its calibration included)", flush=True)
            sched = None if args.draft_process else probe.schedulers[-1]
            snapshot = functools.partial(probe.snapshot, sched, target, draft)
            try:
                warm_up(draft.addr, True, prompts, args.new_tokens)
                for n in conc:
                    if n > args.max_concurrency.get(name, n):
                        continue
                    rows.append(measure_spec(snapshot, draft.addr, prompts[:n], args.new_tokens, name, plain[n],
                                             args.repeats))
                    log_row(rows[-1], args.json)
                    log_policy(draft)
            finally:
                draft.stop()
    finally:
        target.stop()
    return rows


def run_colocated(args) -> list[Row]:
    """`--colocated`: each draft service runs its target in its own process (`serve-draft --target in-process`,
    with --target-flags appended to its flags); plain decoding is that process's own `TargetService.Generate`.
    The target columns stay 0: its verify is a call inside the draft's step (the verify RTT column)."""
    probe = Probe()
    probe.install()
    conc = sorted(set(args.concurrency))
    prompts = load_prompts(args.prompts, max(conc), args.prompt_tokens)
    flags = engine_flags(max(conc), args.prompt_tokens, args.new_tokens) + args.engine_flags.split()
    rows = []
    for name in args.settings:
        setting = SETTINGS[name]
        draft_flags = flags + ["--device", args.draft_device] + args.target_flags.split() + args.draft_flags.split()
        draft = start_draft("in-process", setting, draft_flags, args.draft_process)
        sched = None if args.draft_process else probe.schedulers[-1]
        snapshot = functools.partial(probe.snapshot, sched, None, draft)
        try:
            warm_up(draft.addr, False, prompts, args.new_tokens)
            warm_up(draft.addr, True, prompts, args.new_tokens)
            for n in conc:
                if n > args.max_concurrency.get(name, n):
                    continue
                plain = measure_plain(snapshot, draft.addr, prompts[:n], args.new_tokens, args.repeats)
                rows.append(measure_spec(snapshot, draft.addr, prompts[:n], args.new_tokens, name, plain,
                                         args.repeats))
                log_row(rows[-1], args.json)
                log_policy(draft)
        finally:
            draft.stop()
    return rows


HEADER = ("| setting | N | spec tok/s | plain tok/s | speed-up | tau | steps | propose | target queue | "
          "target verify | target reply | RPC rest | extend | (verify RTT) | admission s | plain step (target) | "
          "match |")


def format_row(r: Row) -> str:
    return (f"| {r.setting} | {r.concurrency} | {r.spec_tok_s:.0f} | {r.plain_tok_s:.0f} | {r.speedup:.2f}x | "
            f"{r.tau:.2f} | {r.steps} | {r.propose_ms:.1f} | {r.target_queue_ms:.1f} | {r.target_ms:.1f} | "
            f"{r.target_reply_ms:.1f} | {r.rpc_ms:.1f} | "
            f"{r.extend_ms:.1f} | {r.verify_rtt_ms:.1f} | {r.admit_s:.2f} | {r.plain_target_ms:.1f} | "
            f"{'yes' if r.match else 'NO'} |"
            + (f" busy {r.gpu_busy}" if r.gpu_busy else ""))


def log_row(row: Row, quiet: bool) -> None:
    print(format_row(row), file=sys.stderr if quiet else sys.stdout, flush=True)


def log_policy(draft) -> None:
    """`--speculation auto`'s measured rates so far and the target steps each budget ran (cumulative over the
    service's life; a draft in its own process: from its /metrics), to stderr."""
    if not hasattr(draft, "metrics_text"):
        return
    rates, steps = [], []
    for line in draft.metrics_text().splitlines():
        budget = re.search(r'budget="([^"]+)"', line)
        value = line.rsplit(" ", 1)[-1]
        if line.startswith("specdec:speculation_policy_tokens_per_second{"):
            bucket = re.search(r'batch_bucket="(\d+)"', line).group(1)
            rates.append(f"bs{bucket} {budget.group(1)} {float(value):.1f}")
        elif line.startswith("specdec:speculation_policy_target_steps_total{"):
            steps.append(f"{budget.group(1)} {float(value):.0f}")
    if rates:
        print("policy:", "; ".join(rates), "| target steps:", ", ".join(steps), file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated request counts, default 1,8,32")
    p.add_argument("--settings", default="eagle1-chain,eagle3-chain,eagle1-tree",
                   help=f"comma-separated, from {', '.join(SETTINGS)}; default eagle1-chain,eagle3-chain,eagle1-tree")
    p.add_argument("--max-concurrency", default="",
                   help="per-setting cap, e.g. eagle1-tree=8,eagle3-chain=8 (higher concurrencies are skipped)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request, default 64")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt = its last N tokens, default 256")
    p.add_argument("--repeats", type=int, default=1, help="runs per measurement, the fastest is kept; default 1")
    p.add_argument("--prompts", type=Path, default=DEV_PROMPTS,
                   help="JSONL prompt file, default ../shared/prompts/dev.jsonl (bundled prompts if absent)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the Markdown table")
    p.add_argument("--target-device", default="cpu", help="the target service's --device, default cpu")
    p.add_argument("--gpu-busy", default="", help="comma-separated GPU indices whose busy fraction (NVML) each "
                   "speculative run records, e.g. 0,1")
    p.add_argument("--target-process", action="store_true",
                   help="run the target service as its own process (as deployed); default: a thread of this one")
    p.add_argument("--draft-process", action="store_true",
                   help="run each draft service as its own process too (its step split is scraped from its metrics)")
    p.add_argument("--draft-device", default="cpu", help="the draft service's --device (cuda:1: its own GPU)")
    p.add_argument("--colocated", action="store_true",
                   help="no target service: each draft runs its target in its own process (--target in-process, "
                        "--target-flags appended to its flags, e.g. '--simulate-accept-len 5'); plain = that "
                        "process's TargetService.Generate")
    p.add_argument("--engine-flags", default="",
                   help="more engine flags for both services, e.g. '--attention-backend flashinfer --dtype bfloat16'")
    p.add_argument("--target-flags", default="", help="flags for the target only (last wins), e.g. "
                   "'--load-format dummy --config llama3-8b --simulate-accept-len 5'")
    p.add_argument("--draft-flags", default="", help="flags for the draft only (last wins), e.g. "
                   "'--load-format dummy --config llama3-8b-eagle1 --target-model llama3-8b'")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.settings = args.settings.split(",")
    unknown = [s for s in args.settings if s not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    args.max_concurrency = {k: int(v) for k, v in (kv.split("=") for kv in args.max_concurrency.split(",") if kv)}
    return args


def environment() -> dict:
    import platform
    import subprocess

    import torch

    cpu = platform.processor()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO_ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    commit = git("rev-parse", "--short", "HEAD")
    if commit and git("status", "--porcelain", "--untracked-files=no"):  # the code is not that commit's (a copied
        commit += "+changes"  # tree whose .git is older, as the device tool's can be: rows said bc29fa2 for b200534)
    return dict(cpu=cpu, num_cpus=os.cpu_count(), torch=torch.__version__, torch_threads=torch.get_num_threads(),
                python=platform.python_version(), commit=commit or "unknown",
                load_avg=[round(x, 2) for x in os.getloadavg()])


MISMATCH = 3  # exit status when a speculative output differed from plain (a crash exits 1)


def main(argv=None) -> int:
    args = parse_args(argv)
    BUSY_GPUS[:] = [int(i) for i in args.gpu_busy.split(",") if i]
    logging.basicConfig(level=logging.WARNING)
    env = environment()
    if not args.json:
        print(", ".join(f"{k} {v}" for k, v in env.items()) + "; per-step columns in ms per step")
        print(HEADER)
        print("|" + " --- |" * HEADER.count(" |"))
    t0 = time.perf_counter()
    rows = run(args)
    if args.json:
        settings = {n: asdict(SETTINGS[n]) for n in args.settings}
        print(json.dumps(dict(environment=env, settings=settings, new_tokens=args.new_tokens,
                              prompt_tokens=args.prompt_tokens, repeats=args.repeats, rows=[asdict(r) for r in rows],
                              elapsed_s=time.perf_counter() - t0), indent=2))
    else:
        print(f"total {time.perf_counter() - t0:.0f} s, load average at the end {os.getloadavg()[0]:.2f}")
    simulated = "--simulate-accept-len" in args.target_flags  # outputs differ from plain by construction
    return 0 if simulated or all(r.match for r in rows) else MISMATCH


if __name__ == "__main__":
    sys.exit(main())
