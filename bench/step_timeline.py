"""Where a speculative step's time goes through the services, read from their own trace spans.

Starts the target and the draft as their own processes (`python -m specdec serve-*`, as deployed) with tracing on
(`OTEL_EXPORTER_OTLP_ENDPOINT` -> an OTLP/gRPC receiver in this process, every request and every step sampled:
`SPECDEC_STEP_SPAN_RATIO=1`), sends `--requests` greedy requests `--concurrency` at a time to the draft's
`Generate`, stops both services (they flush their spans) and lines the spans of each step up on the host clock
(one machine: both processes read the same clock). Per step, in ms (mean, median and 90th percentile):

    propose          draft.propose: the draft's tree growth
    draft to send    draft.verify start -> its Verify client span start (the draft packing the trees)
    request          client span start -> the target's server span start: gRPC out, the handler starting
    to engine        server span start -> target.verify_batch start: the hand-off to the target's engine thread
    forward          target.verify_batch: the target's forward, acceptance, features to host
    to reply         target.verify_batch end -> server span end: back to the event loop, packing the reply
    reply            server span end -> client span end: gRPC back, the draft reading the reply
    after reply      client span end -> draft.verify end
    to extend        draft.verify end -> draft.extend start: committing the tokens
    extend           draft.extend: the draft's extend over the accepted tokens
    between steps    draft.extend end -> the next step's draft.propose start: the engine loop, streaming, the budget
    step             draft.propose start -> the next one's

Plain calls (`--draft-flags "--speculation off"`, or `auto` when it decodes plainly: a `draft.verify` with
`num_draft_tokens` 0) get a table of their own, per call:

    send .. reply    as above (send: draft.verify start -> its client span start)
    after reply      client span end -> draft.verify end: the reply waiting to be landed (pipelined calls)
    call             draft.verify start -> end
    target gap       the previous target.verify_batch's end -> this one's start: the target's engine idle
    cadence          the previous target.verify_batch's start -> this one's
    tokens           the call's plain steps; feature rows: what it asked back per request (target.verify_batch)

Tracing itself costs a little per span (see docs/benchmarks.md, "Tracing cost"); read the parts, not the total,
against an untraced run. With `--speculation always` (the default here) every step is one propose, one Verify and
one extend; a step of several requests is one set of spans (the first request's trace).

    python bench/step_timeline.py [--requests 8] [--new-tokens 128] [--concurrency 1] [--setting eagle1-chain]
        [--target-device cpu] [--draft-device cpu] [--engine-flags ...] [--target-flags ...] [--draft-flags ...]
        [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))

from otlp_receiver import OtlpReceiver, Span  # noqa: E402
from services_bench import SETTINGS, engine_flags, load_prompts, run_batch, start_draft, start_target  # noqa: E402

SERVER, CLIENT = 2, 3  # OTLP's SpanKind numbers
PARTS = ("propose", "draft to send", "request", "to engine", "forward", "to reply", "reply", "after reply",
         "to extend", "extend", "between steps", "step")
PLAIN_PARTS = ("send", "request", "to engine", "forward", "to reply", "reply", "after reply", "call", "target gap",
               "cadence", "tokens", "feature rows")


def steps_of(spans: list[Span]) -> list[dict[str, float]]:
    """Each speculative step's parts in ms (see the module doc); steps whose spans are incomplete are left out."""
    children: dict[bytes, list[Span]] = {}
    for s in spans:
        children.setdefault(s.parent_id, []).append(s)

    def child(span: Span, name: str | None = None, kind: int | None = None) -> Span | None:
        for c in children.get(span.span_id, []):
            if (name is None or c.name == name) and (kind is None or c.kind == kind):
                return c
        return None

    ms = lambda a, b: (b - a) / 1e6  # noqa: E731
    by_parent: dict[bytes, list[Span]] = {}
    for s in spans:
        if s.name in ("draft.propose", "draft.verify", "draft.extend"):
            by_parent.setdefault(s.parent_id, []).append(s)
    steps = []
    for group in by_parent.values():
        group.sort(key=lambda s: s.start)
        for i, p in enumerate(group):
            if p.name != "draft.propose" or i + 2 >= len(group):
                continue
            v, e = group[i + 1], group[i + 2]
            if v.name != "draft.verify" or e.name != "draft.extend":
                continue
            c = child(v, kind=CLIENT)
            srv = child(c, kind=SERVER) if c else None
            batch = child(srv, "target.verify_batch") if srv else None
            if batch is None:
                continue
            nxt = next((q for q in group[i + 3:] if q.name == "draft.propose"), None)
            part = {"propose": ms(p.start, p.end), "draft to send": ms(v.start, c.start),
                    "request": ms(c.start, srv.start), "to engine": ms(srv.start, batch.start),
                    "forward": ms(batch.start, batch.end), "to reply": ms(batch.end, srv.end),
                    "reply": ms(srv.end, c.end), "after reply": ms(c.end, v.end), "to extend": ms(v.end, e.start),
                    "extend": ms(e.start, e.end)}
            if nxt is not None:
                part["between steps"] = ms(e.end, nxt.start)
                part["step"] = ms(p.start, nxt.start)
            steps.append(part)
    return steps


def plain_calls_of(spans: list[Span]) -> list[dict[str, float]]:
    """Each plain call's parts in ms (see PLAIN_PARTS in the module doc); calls whose spans are incomplete are left
    out. Pipelined calls overlap: `after reply` holds the wait until the scheduler lands the call, and `target gap`
    is the target's engine idle between the end of the previous call's forward and the start of this one's."""
    by_id = {s.span_id: s for s in spans}
    clients = {s.parent_id: s for s in spans if s.kind == CLIENT}
    servers = {s.parent_id: s for s in spans if s.kind == SERVER}
    batches = {s.parent_id: s for s in spans if s.name == "target.verify_batch"}
    ms = lambda a, b: (b - a) / 1e6  # noqa: E731
    calls = []
    for v in spans:
        if v.name != "draft.verify" or v.attributes.get("num_draft_tokens", -1) != 0:
            continue
        c = clients.get(v.span_id)
        srv = servers.get(c.span_id) if c else None
        batch = batches.get(srv.span_id) if srv else None
        if batch is None or batch.parent_id not in by_id:
            continue
        calls.append((batch, {"send": ms(v.start, c.start), "request": ms(c.start, srv.start),
                              "to engine": ms(srv.start, batch.start), "forward": ms(batch.start, batch.end),
                              "to reply": ms(batch.end, srv.end), "reply": ms(srv.end, c.end),
                              "after reply": ms(c.end, v.end), "call": ms(v.start, v.end),
                              "tokens": float(batch.attributes.get("plain_steps", 0)),
                              "feature rows": float(batch.attributes.get("feature_rows", 0))}))
    # every forward, speculative ones too
    forwards = sorted((s for s in spans if s.name == "target.verify_batch"), key=lambda s: s.start)
    starts = [s.start for s in forwards]
    out = []
    for batch, part in calls:
        i = starts.index(batch.start)
        if i > 0:
            part["target gap"] = ms(forwards[i - 1].end, batch.start)
            part["cadence"] = ms(forwards[i - 1].start, batch.start)
        out.append(part)
    return out


def summary(steps: list[dict[str, float]], parts=PARTS) -> dict[str, dict[str, float]]:
    out = {}
    for name in parts:
        values = sorted(s[name] for s in steps if name in s)
        if values:
            out[name] = {"mean": statistics.fmean(values), "median": statistics.median(values),
                         "p90": values[int(0.9 * (len(values) - 1))], "n": len(values)}
    return out


def run(args) -> dict:
    store = OtlpReceiver(keep=True)
    os.environ.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{store.port}",
                      OTEL_TRACES_SAMPLER="parentbased_always_on", SPECDEC_STEP_SPAN_RATIO="1.0",
                      OTEL_BSP_MAX_QUEUE_SIZE="65536")
    setting = SETTINGS[args.setting]
    prompts = load_prompts(args.prompts, args.requests, args.prompt_tokens)
    flags = engine_flags(args.concurrency, args.prompt_tokens, args.new_tokens) + args.engine_flags.split()
    target = start_target(flags + ["--device", args.target_device] + args.target_flags.split(), own_process=True)
    try:
        draft_flags = (flags + ["--device", args.draft_device, "--speculation", "always"]
                       + args.draft_flags.split())
        draft = start_draft(target.addr, setting, draft_flags, own_process=True)
        try:
            asyncio.run(run_batch(draft.addr, True, prompts[:2], 16, "warm"))
            measured_from = time.time_ns()  # the warm-up's spans start before
            walls, tokens = [], 0
            for start in range(0, args.requests, args.concurrency):
                batch = prompts[start:start + args.concurrency]
                wall, outs, _ = asyncio.run(run_batch(draft.addr, True, batch, args.new_tokens, f"t{start}"))
                walls.append(wall)
                tokens += sum(len(o) for o in outs)
        finally:
            draft.stop()
    finally:
        target.stop()
    store.stop()
    measured = [s for s in store.spans if s.start >= measured_from]
    steps, plain = steps_of(measured), plain_calls_of(measured)
    return {"setting": args.setting, "requests": args.requests, "concurrency": args.concurrency,
            "new_tokens": args.new_tokens, "tokens_per_s": tokens / sum(walls), "num_steps": len(steps),
            "parts_ms": summary(steps), "num_plain_calls": len(plain), "plain_parts_ms": summary(plain, PLAIN_PARTS)}


def format_table(result: dict) -> str:
    lines = [f"{result['setting']}, {result['requests']} requests, {result['concurrency']} at a time: "
             f"{result['tokens_per_s']:.1f} tok/s traced, {result['num_steps']} steps",
             "| part | mean ms | median | p90 |", "| --- | --- | --- | --- |"]
    for name, v in result["parts_ms"].items():
        lines.append(f"| {name} | {v['mean']:.3f} | {v['median']:.3f} | {v['p90']:.3f} |")
    if result["num_plain_calls"]:
        lines += ["", f"{result['num_plain_calls']} plain calls", "| part | mean ms | median | p90 |",
                  "| --- | --- | --- | --- |"]
        for name, v in result["plain_parts_ms"].items():
            lines.append(f"| {name} | {v['mean']:.3f} | {v['median']:.3f} | {v['p90']:.3f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", default="eagle1-chain", choices=sorted(SETTINGS))
    p.add_argument("--requests", type=int, default=8, help="requests measured, default 8")
    p.add_argument("--concurrency", type=int, default=1, help="requests at a time, default 1")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens a request, default 128")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt = its last N tokens, default 256")
    p.add_argument("--prompts", type=Path, default=REPO_ROOT / "prompts" / "dev.jsonl")
    p.add_argument("--target-device", default="cpu")
    p.add_argument("--draft-device", default="cpu")
    p.add_argument("--engine-flags", default="", help="flags for both services")
    p.add_argument("--target-flags", default="", help="flags for the target only")
    p.add_argument("--draft-flags", default="", help="flags for the draft only (after --speculation always)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0 if result["num_steps"] or result["num_plain_calls"] else 1


if __name__ == "__main__":
    sys.exit(main())
