"""What tracing costs: tokens/s through gateway -> draft -> target (the tiny pair) with tracing off and on.

Each mode starts the three services as processes (`python -m specdec serve-*`, as `specdec up` does) with its own
environment, warms up, then sends `--rounds` rounds of `--concurrency` concurrent greedy requests (`ignore_eos`,
`--new-tokens` each) to the gateway and records completion tokens / wall seconds per round. Modes run in turns
(off, on, off, on, ... `--repeats` times each, a fresh stack every time) so that drift on a shared machine hits
both alike; the report gives each mode's median round, the cost relative to `off`, and the CPU time the three
service processes spent per generated token (less sensitive than tokens/s to other load on a shared machine).

    off      no OTEL_* variables: no SDK provider, no interceptors (the default)
    on       OTEL_EXPORTER_OTLP_ENDPOINT -> an OTLP/gRPC receiver in this process, sampler parentbased_always_on
             (ratio 1.0), SPECDEC_STEP_SPAN_RATIO=1.0: every request and every speculative step traced
    on-req   as `on` with SPECDEC_STEP_SPAN_RATIO=0 (request spans only: the recommended production setting)

    python bench/tracing_cost.py [--modes off,on,on-req] [--concurrency 8] [--new-tokens 64] [--rounds 4]
                                 [--repeats 2] [--device cpu] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402
from otlp_receiver import OtlpReceiver  # noqa: E402

from gateway.local_stack import HEALTH_NAMES, StackConfig, _is_serving  # noqa: E402
from specdec.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc  # noqa: E402

PROMPTS = [
    'def shortest_path_length(G, source, target):\n    """Return the length of the shortest path."""\n',
    'def is_bipartite(G):\n    """Returns True if graph G is bipartite, False if not."""\n',
    'class Stack:\n    """A last-in first-out container."""\n\n    def __init__(self):\n',
    'def degree_histogram(G):\n    """Returns a list of the frequency of each degree value."""\n',
]
SERVICES = ("target", "draft", "gateway")
TRACING_ENV = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME",
               "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_SDK_DISABLED", "SPECDEC_STEP_SPAN_RATIO")


def mode_env(mode: str, receiver: OtlpReceiver) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TRACING_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    if mode != "off":
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.port}",
                   OTEL_TRACES_SAMPLER="parentbased_always_on",
                   SPECDEC_STEP_SPAN_RATIO="1.0" if mode == "on" else "0.0")
    return env


class Stack:
    def __init__(self, config: StackConfig, env: dict[str, str], log_dir: str) -> None:
        self.config, self.procs, self.log_dir = config, {}, log_dir
        for name, argv in config.commands().items():
            argv = [*argv, "--drain-seconds", "1"]
            with open(os.path.join(log_dir, f"{name}.log"), "wb") as log:
                self.procs[name] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                    cwd=REPO_ROOT)
        try:
            self.wait_serving()
        except BaseException:
            self.stop()
            raise

    def wait_serving(self, timeout_s: float = 240.0) -> None:
        deadline, waiting = time.monotonic() + timeout_s, list(SERVICES)
        while waiting:
            for name in list(waiting):
                if self.procs[name].poll() is not None:
                    tail = Path(self.log_dir, f"{name}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited with {self.procs[name].returncode}:\n{tail}")
                if _is_serving(self.config.addr(name), HEALTH_NAMES[name]):
                    waiting.remove(name)
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"not serving after {timeout_s} s: {waiting}")
            time.sleep(0.2)

    def cpu_s(self) -> float:
        """User + system CPU seconds the three services have used so far (Linux /proc)."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for proc in self.procs.values():
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        return total / tick

    def stop(self) -> None:
        for name in ("gateway", "draft", "target"):
            proc = self.procs[name]
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def one_round(addr: str, concurrency: int, new_tokens: int, tag: str) -> tuple[float, int, float]:
    """`concurrency` requests at once; returns (wall seconds, completion tokens, mean tau)."""
    sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)

        async def request(i: int):
            req = gateway_pb2.GatewayServiceGenerateRequest(prompt=PROMPTS[i % len(PROMPTS)], sampling=sampling,
                                                            request_id=f"{tag}-{i}")
            final = None
            async for msg in stub.Generate(req, timeout=300):
                if msg.HasField("final"):
                    final = msg.final
            return final

        t0 = time.perf_counter()
        finals = await asyncio.gather(*(request(i) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    return wall, sum(f.completion_tokens for f in finals), statistics.mean(f.tau for f in finals)


def measure(mode: str, args, receiver: OtlpReceiver) -> list[dict]:
    config = StackConfig.free_ports(device=args.device, speculation="always")
    spans_before = receiver.num_spans
    with tempfile.TemporaryDirectory(prefix="specdec-tracing-cost-") as log_dir:
        stack = Stack(config, mode_env(mode, receiver), log_dir)
        try:
            asyncio.run(one_round(config.addr("gateway"), 2, 8, f"{mode}-warm"))
            rounds = []
            for r in range(args.rounds):
                cpu0 = stack.cpu_s()
                wall, tokens, tau = asyncio.run(one_round(config.addr("gateway"), args.concurrency,
                                                          args.new_tokens, f"{mode}-{r}"))
                cpu_ms = 1000 * (stack.cpu_s() - cpu0) / tokens
                rounds.append({"mode": mode, "tok_s": tokens / wall, "tokens": tokens, "wall_s": wall, "tau": tau,
                               "cpu_ms_per_token": cpu_ms})
        finally:
            stack.stop()
    time.sleep(0.5)  # the last exports
    for row in rounds:
        row["spans_per_round"] = (receiver.num_spans - spans_before) / (args.rounds + 1)
    return rounds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="off,on,on-req")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="measured rounds per stack")
    p.add_argument("--repeats", type=int, default=2, help="stacks per mode, taken in turns")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    modes = args.modes.split(",")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the stack in flight
    receiver = OtlpReceiver()
    rows: list[dict] = []
    try:
        for rep in range(args.repeats):
            for mode in modes:
                got = measure(mode, args, receiver)
                rows += got
                print(f"[{rep}] {mode:7s} " + " ".join(f"{r['tok_s']:.1f}" for r in got) + " tok/s", file=sys.stderr)
    finally:
        receiver.stop()
    summary = {}
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {"median_tok_s": statistics.median(r["tok_s"] for r in mine),
                         "mean_tok_s": statistics.mean(r["tok_s"] for r in mine),
                         "stdev_tok_s": statistics.stdev(r["tok_s"] for r in mine) if len(mine) > 1 else 0.0,
                         "tau": statistics.mean(r["tau"] for r in mine),
                         "cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in mine),
                         "spans_per_round": statistics.mean(r["spans_per_round"] for r in mine),
                         "rounds": len(mine)}
    base = summary.get("off", {}).get("median_tok_s")
    for values in summary.values():
        values["cost_pct"] = 100.0 * (1 - values["median_tok_s"] / base) if base else None
    if args.json:
        print(json.dumps({"args": vars(args), "summary": summary, "rounds": rows}, indent=2))
        return
    header = ("mode", "tok/s (median)", "mean", "stdev", "cost", "cpu ms/token", "tau", "spans/round")
    print("{:8s} {:>15s} {:>8s} {:>7s} {:>7s} {:>13s} {:>5s} {:>12s}".format(*header))
    for mode, v in summary.items():
        cost = "" if v["cost_pct"] is None else f"{v['cost_pct']:+.1f}%"
        print(f"{mode:8s} {v['median_tok_s']:15.1f} {v['mean_tok_s']:8.1f} {v['stdev_tok_s']:7.1f} {cost:>7s} "
              f"{v['cpu_ms_per_token']:13.2f} {v['tau']:5.2f} {v['spans_per_round']:12.0f}")


if __name__ == "__main__":
    main()
