"""How long a running stream stops while a long prompt (or a burst of prompts) is admitted, with the target's prompt
in one forward (`--prefill-chunk-tokens 0`) and in parts (`specdec.engine.prefill_parts`).

Per setting: stream A (a short prompt) runs; once it has streamed `--lead-messages` messages, B is sent: one
`--long-tokens` prompt, or with `--burst N` N such prompts at once. Reported per setting (median over `--repeats`):
A's longest gap between two messages while B is admitted (from B's send to the last B's first token), B's time to
first token (the last B's, and the mean over a burst), and A's tokens/s over the whole run; `--streams N` runs N A
streams (the longest gap of any). B's text is checked against the target's own Generate. `--pair`: `remote`
(target and draft as their own processes, as deployed), `colocated` (one draft process with `--target
in-process`), `target` (A and B through the target's own plain `Generate`).

CPU, the tiny pair:     python bench/prefill_parts.py
A burst of short ones:  python bench/prefill_parts.py --burst 16 --long-tokens 200 --chunks 0,512
GPU, 8B shape (dummy):  python bench/prefill_parts.py --long-tokens 8000 --target-flags "--load-format dummy \
    --config llama3-8b --device cuda:0 --attention-backend flashinfer --dtype bfloat16 --max-context 16384 \
    --simulate-accept-len 5" --draft-flags "--load-format dummy --config llama3-8b-eagle1 --target-model llama3-8b \
    --device cuda:0 --attention-backend flashinfer --dtype bfloat16 --max-context 16384"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from service_process import REPO_ROOT, ServiceProcess  # noqa: E402

from specdec.rpc.channel import make_channel  # noqa: E402
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc  # noqa: E402


def _sampling(n: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_new_tokens=n, ignore_eos=True)


async def _stream(call, request, arrivals: list) -> list[int]:
    tokens = []
    async for msg in call(request):
        tokens += list(msg.token_ids)
        arrivals.append(time.monotonic())
    return tokens


def _generate(stub, rid: str, prompt: list[int], n: int, arrivals: list):
    """A Generate stream through the draft (DraftServiceStub) or the target (TargetServiceStub)."""
    kind = draft_pb2.DraftServiceGenerateRequest if isinstance(stub, draft_pb2_grpc.DraftServiceStub) else \
        target_pb2.TargetServiceGenerateRequest
    return _stream(stub.Generate, kind(request_id=rid, prompt_ids=prompt, sampling=_sampling(n)), arrivals)


async def one_round(draft_addr: str, target_addr: str, short: list[int], longs: list[list[int]], args,
                    tag: str) -> dict:
    async with make_channel(draft_addr) as dch, make_channel(target_addr) as tch:
        t = target_pb2_grpc.TargetServiceStub(tch)
        d = t if args.pair == "target" else draft_pb2_grpc.DraftServiceStub(dch)
        a_times = [[] for _ in range(args.streams)]
        b_times = [[] for _ in longs]
        a = [asyncio.ensure_future(_generate(d, f"a{i}-{tag}", short[i:] + short[:i], args.a_tokens, times))
             for i, times in enumerate(a_times)]
        t0 = time.monotonic()
        while a and min(len(t) for t in a_times) < args.lead_messages and not all(x.done() for x in a):
            await asyncio.sleep(0.001)
        b_sent = time.monotonic()
        bs = await asyncio.gather(*(_generate(d, f"b{j}-{tag}", long, args.b_tokens, times)
                                    for j, (long, times) in enumerate(zip(longs, b_times, strict=True))))
        a_tokens = await asyncio.gather(*a)
        first_b = max(times[0] for times in b_times)
        gaps = []
        for times in a_times:  # each A stream's longest silence from B's send to B's first token (ended by that
            after = next((t for t in times if t >= first_b), first_b)  # stream's first message after it, if any)
            marks = [b_sent, *(t for t in times if b_sent < t < first_b), after]
            gaps += [t2 - t1 for t1, t2 in zip(marks, marks[1:], strict=False)]
        matches = None
        if args.check:  # (the target's own Generate, one at a time)
            plain = [await _generate(t, f"p{j}-{tag}", long, args.b_tokens, []) for j, long in enumerate(longs)]
            matches = bs == plain
        return {"a_max_gap_s": max(gaps, default=first_b - b_sent), "b_ttft_s": first_b - b_sent,
                "b_ttft_mean_s": statistics.mean(times[0] - b_sent for times in b_times),
                "a_messages_during_b": sum(b_sent < t < first_b for times in a_times for t in times),
                "a_tokens_per_s": sum(map(len, a_tokens)) / (max(t[-1] for t in a_times) - t0) if a else 0.0,
                "b_matches_target": matches}


def _services(chunk: int, args) -> list[ServiceProcess]:
    """The processes of the `--pair` setting, started; the last one's address serves both services' Generate."""
    common = ["--log-level", "WARNING", "--drain-seconds", "1", "--prefill-chunk-tokens", str(chunk)]
    draft_args = [*shlex.split(args.draft_flags), *common, "--speculation", args.speculation]
    if args.pair == "colocated":
        return [ServiceProcess(["serve-draft", "--target", "in-process", *draft_args], "specdec.v1.DraftService")]
    procs = [ServiceProcess(["serve-target", *shlex.split(args.target_flags), *common], "specdec.v1.TargetService")]
    if args.pair == "remote":
        try:
            procs.append(ServiceProcess(["serve-draft", "--target", procs[0].addr, *draft_args],
                                        "specdec.v1.DraftService"))
        except BaseException:
            procs[0].stop()
            raise
    return procs


def run_setting(chunk: int, short, longs, args) -> dict:
    procs = _services(chunk, args)
    draft, target = procs[-1], procs[0]
    try:
        asyncio.run(one_round(draft.addr, target.addr, short, longs, args, "warm"))
        rounds = [asyncio.run(one_round(draft.addr, target.addr, short, longs, args, f"r{i}"))
                  for i in range(args.repeats)]
    finally:
        for proc in reversed(procs):
            proc.stop()
    med = {k: round(statistics.median(r[k] for r in rounds), 4) for k in
           ("a_max_gap_s", "b_ttft_s", "b_ttft_mean_s", "a_messages_during_b", "a_tokens_per_s")}
    return {"prefill_chunk_tokens": chunk, **med, "b_matches_target": [r["b_matches_target"] for r in rounds]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunks", default="0,2048,512", help="--prefill-chunk-tokens settings, comma-separated")
    p.add_argument("--long-tokens", type=int, default=1800, help="stream B's prompt length")
    p.add_argument("--streams", type=int, default=1, help="A streams running when B is sent (0: B alone, its TTFT)")
    p.add_argument("--burst", type=int, default=1, help="B prompts sent at once")
    p.add_argument("--pair", choices=["remote", "colocated", "target"], default="remote",
                   help="target and draft processes; a draft with its target in-process; the target's Generate")
    p.add_argument("--a-tokens", type=int, default=400, help="each A stream's new tokens")
    p.add_argument("--b-tokens", type=int, default=16, help="stream B's new tokens")
    p.add_argument("--lead-messages", type=int, default=5, help="A's messages before B is sent")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--speculation", default="always")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="compare B's text with the target's Generate (off for SIMULATED acceptance)")
    p.add_argument("--target-flags", default=f"--model {TINY / 'target'}")
    p.add_argument("--draft-flags", default=f"--model {TINY / 'draft'} --target-model {TINY / 'target'}")
    p.add_argument("--out", help="write the rows as JSON here too")
    args = p.parse_args(argv)
    vocab = 8000
    short = [(7 * i + 11) % vocab + 100 for i in range(32)]
    longs = [[(13 * i + 5 + 17 * j) % vocab + 100 for i in range(args.long_tokens)] for j in range(args.burst)]
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        row = run_setting(chunk, short, longs, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


TINY = REPO_ROOT / "models" / "tiny-code"

if __name__ == "__main__":
    raise SystemExit(main())
