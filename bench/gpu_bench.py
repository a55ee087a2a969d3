"""GPU benchmark (issue 6): floors, 8B-shaped plain decode and verify vs the floor, draft step times, simulated
acceptance speedups, the tiny pair's real tau and speed, and transformers' generate, all in one run.

    python bench/gpu_bench.py --out results.json            # on a CUDA machine
    python bench/gpu_bench.py --sections floors,plain8b     # a subset
    python bench/gpu_bench.py --sections floors,plain8b,plain --batch-sizes 1,8,64,128   # plain decode per batch
    python bench/gpu_bench.py --sections floors,plain8b,simulated --batch-sizes 1,8 --draft-config llama3-8b-eagle3

Every section is timed with CUDA events after warm-up; each writes its results even if a later one fails.
Simulated-acceptance rows are labelled SIMULATED: their outputs are not the target's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draft_service.cli import DRAFT_GPU_PLAIN_STEPS  # noqa: E402
from specdec.engine.adaptive import FULL, SpeculationPolicy, budget_menu  # noqa: E402
from specdec.engine.calibration import batch_sizes_up_to, calibrate  # noqa: E402
from specdec.engine.draft_engine import SpecConfig  # noqa: E402
from specdec.engine.factory import EngineOptions, build_draft, build_target  # noqa: E402
from specdec.engine.generate import feature_layers_for, generate  # noqa: E402
from specdec.engine.overlap import TwoBatchOverlap  # noqa: E402
from specdec.engine.plain_steps import PLAIN_STEPS  # noqa: E402
from specdec.engine.requests import StepTimings, VerifyInput  # noqa: E402
from specdec.engine.scheduler import Scheduler  # noqa: E402
from specdec.engine.warmup import warm_verify_shapes  # noqa: E402
from specdec.models.token_map import write_token_map  # noqa: E402
from specdec.sampling_params import SamplingParams  # noqa: E402
from specdec.serving.long_lived import freeze_start_up_objects  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny-code"


def _sync():
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        torch.cuda.synchronize(i)


def _sync_time(fn, repeat=1):
    _sync()
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = fn()
    _sync()
    return (time.perf_counter() - t0) / repeat, out


def floors(res):
    n = 1 << 30  # 2 GiB of bf16
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    t, _ = _sync_time(lambda x=x, y=y: y.copy_(x), 10)
    bw = 2 * x.numel() * 2 / t
    res["copy_bandwidth_GBps"] = round(bw / 1e9, 1)
    del x, y
    torch.cuda.empty_cache()
    return bw


DEVICE = "cuda"
TOKEN_MAP = ""  # --draft-vocab N: a token-map file of the first N ids for the simulated rows' EAGLE-1 head


def _opts(backend, **kw):
    return EngineOptions(device=DEVICE, dtype="bfloat16" if DEVICE == "cuda" else "float32",
                         attention_backend=backend, **kw)


def _decode_rate(target, draft, prompts, new_tokens, policy=None, timings=None, overlap=None, busy=None,
                 plain_steps=PLAIN_STEPS, repeats=1, warm_up=True, **sp):
    """(tokens/s, tokens per target step) of the run after a first identical one (which warms up; with a
    `policy` it also trains it, so the timed run shows the policy's settled choice); `repeats` > 1: the median
    of that many timed runs (a tiny-pair run is tens of ms); `warm_up=False`: the first run is the timed one (a
    policy's cold start). `timings` (a StepTimings) collects where the last timed run's time went; `busy` (a
    GpuBusy) is entered around the timed runs."""
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, **sp)
    run = partial(generate, target, draft, prompts, params, max_batch_size=len(prompts), policy=policy,
                  overlap=overlap, plain_steps=plain_steps)
    if warm_up:
        run()
    times = []
    with busy if busy is not None else contextlib.nullcontext():
        for _ in range(repeats):
            t, out = _sync_time(partial(run, timings=timings))
            times.append(t)
    t = sorted(times)[len(times) // 2]
    toks = sum(len(r.tokens) for r in out)
    steps = sum(r.num_verify_steps for r in out)
    tau = sum(len(r.tokens) - 1 for r in out) / steps if steps and draft is not None else 1.0
    return toks / t, tau


def _allocator_counts() -> dict:
    """The CUDA caching allocator's running counts (a retry frees the cache and synchronizes; a device alloc is a
    cudaMalloc): a slow admission that these move with is the allocator's, not the engines'."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")}


def _split(t: StepTimings) -> dict:
    """Where a run's time went: admission, plain steps and speculative steps (count, ms per step)."""
    return {"admit_s": round(t.admit_s, 3),
            "plain_steps": t.plain_steps, "plain_ms": round(t.plain_s / max(t.plain_steps, 1) * 1e3, 2),
            "spec_steps": t.spec_steps, "spec_ms": round(t.spec_s / max(t.spec_steps, 1) * 1e3, 2),
            **{f"{part}_ms": round(getattr(t, f"{part}_s") / max(t.spec_steps, 1) * 1e3, 2)
               for part in ("propose", "verify", "extend")}}


def plain8b(res, args, bw):
    opts = _opts(args.backend, dummy_weights=True, max_batch_size=max(args.batch_sizes), max_context=4096,
                 num_pages=8192)
    target = build_target("llama3-8b", opts)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    floor_s = weight_bytes / bw
    res["weight_GB"] = round(weight_bytes / 1e9, 2)
    res["floor_ms_per_forward"] = round(floor_s * 1e3, 3)
    res["floor_tokens_per_s_bs1"] = round(1 / floor_s, 1)
    # the floor above counts every weight, as the shared reference numbers do; a forward reads one row of an
    # untied embedding table (1.05 GB of the 8B shape's 16.06), so its least time is that much less
    embed = target.model.model.embed_tokens.weight
    read_s = floor_s - (0 if target.model.lm_head.weight is embed else embed.numel() * embed.element_size()) / bw
    res["floor_read_ms_per_forward"] = round(read_s * 1e3, 3)
    prompt = [list(range(1000, 1512))]
    graphs, target.graphs = target.graphs, None
    rate, _ = _decode_rate(target, None, prompt, args.new_tokens)
    res["plain_tokens_per_s_bs1_eager"] = round(rate, 1)
    target.graphs = graphs
    rate, _ = _decode_rate(target, None, prompt, args.new_tokens)
    res["plain_tokens_per_s_bs1"] = round(rate, 1)
    res["plain_fraction_of_floor"] = round(rate * floor_s, 3)
    res["plain_fraction_of_read_floor"] = round(rate * read_s, 3)
    for steps in (1, 16):  # tokens per call (one host sync each; the default is PLAIN_STEPS): the boundary's cost
        rate, _ = _decode_rate(target, None, prompt, args.new_tokens, plain_steps=steps)
        res[f"plain_tokens_per_s_bs1_{steps}_per_call"] = round(rate, 1)
        res[f"plain_fraction_of_read_floor_{steps}_per_call"] = round(rate * read_s, 3)
    res["cuda_graphs"] = target.graphs is not None
    try:
        _verify_times(res, target, prompt, floor_s, read_s)
    except Exception:  # noqa: BLE001 - keep the target for the other sections
        res["verify8b_error"] = traceback.format_exc()[-1500:]
    res["note"] = "flashinfer attention; target decode/verify replayed from CUDA graphs; draft eager"
    return target


def _verify_times(res, target, prompt, floor_s, read_s):
    from specdec.engine.requests import PrefillInput

    for n_draft, topk in ((8, 1), (64, 8)):
        rid = f"v{n_draft}"
        target.prefill([PrefillInput(rid, prompt[0], SamplingParams(max_new_tokens=10000, ignore_eos=True))])
        parents = [-1] * topk + [i - topk for i in range(topk, n_draft)] if topk > 1 else list(range(-1, n_draft - 1))
        inp = [VerifyInput(rid, [7] * n_draft, parents)]
        for _ in range(3):
            target.verify(inp)
        t, _ = _sync_time(lambda inp=inp: target.verify(inp), 20)
        res[f"verify_ms_{n_draft}_draft_tokens"] = round(t * 1e3, 3)
        res[f"verify_{n_draft}_vs_floor"] = round(t / floor_s, 3)
        res[f"verify_{n_draft}_vs_read_floor"] = round(t / read_s, 3)
        target.release(rid)


def profile8b(res, args, target):
    """Where a bs-1 plain decode step of the 8B shape spends its time (CPU launch overhead vs GPU kernels)."""
    from torch.profiler import ProfilerActivity, profile

    prompts = [list(range(1000, 1512))]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    generate(target, None, prompts, params)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        generate(target, None, prompts, params)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    table_gpu = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
    Path(args.out).with_suffix(".profile.txt").write_text(table + "\n\n" + table_gpu)
    res["profile_written"] = str(Path(args.out).with_suffix(".profile.txt"))


def draft8b(res, args, target):
    opts = _opts(args.backend, dummy_weights=True, max_batch_size=32, max_context=4096, num_pages=4096,
                 token_map=TOKEN_MAP)
    for kind in ("llama3-8b-eagle1",):
        draft = build_draft(kind, "llama3-8b", SpecConfig(6, 1, 6), opts, target.max_context)
        rid = "d0"
        draft.add(rid, 2000)
        feats = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
        draft.extend([(rid, list(range(512)), feats)])
        draft.propose([rid])  # the first call captures the graph ladder
        t, _ = _sync_time(partial(draft.propose, [rid]), 20)
        res[f"{kind}_propose_ms_chain6"] = round(t * 1e3, 3)
        t, _ = _sync_time(partial(_extend_and_rewind, draft, rid, feats[:4]), 20)
        res[f"{kind}_extend4_ms"] = round(t * 1e3, 3)
        draft.release(rid)
    torch.cuda.empty_cache()


def _extend_and_rewind(draft, rid, feats):
    """Extend over 4 tokens, then drop them again so every repetition sees the same length."""
    n = draft.requests[rid].kv_len
    draft.extend([(rid, [5, 6, 7, 8], feats)])
    draft.kv.resize(rid, n)
    draft.requests[rid].kv_len = n


def simulated(res, args, target):
    """Plain vs speculative decoding at simulated acceptance, per batch size: speculation always on
    (`--speculation always`) and adaptive (`auto`: per step, whichever mode measured faster), the latter from a
    fresh policy (`auto_*`), again with the policy that run left (`auto_warm_*`), and with that policy as the draft
    service runs it (`auto_service_*`: its scheduler always keeps a `TwoBatchOverlap`, here without micro-batches,
    so two plain calls are in flight and a call's landing runs while the next one decodes; speculative steps stay
    synchronous). Plain decoding is the target's own (its `Generate`: one call at a time). Each row keeps the
    policy's records (`auto_history`) and every call of the timed runs (`plain_calls`, `spec_calls`,
    `auto_calls`)."""
    draft = simulated_draft(target, args.draft_config, args.backend, max(args.batch_sizes))
    res["simulated_draft"] = args.draft_config
    rows = []
    for bs in args.batch_sizes:
        prompts = [list(range(1000 + i, 1256 + i)) for i in range(bs)]
        target.simulate_accept_len = 0.0
        plain_t = StepTimings(calls=[])
        plain, _ = _decode_rate(target, None, prompts, args.new_tokens, timings=plain_t)
        for tau in (3.0, 5.0):
            target.simulate_accept_len = tau
            spec_t = StepTimings(calls=[])
            spec, measured_tau = _decode_rate(target, draft, prompts, args.new_tokens, timings=spec_t)
            policy = SpeculationPolicy(budget_menu(draft.spec.num_draft_tokens), history=[])
            auto_t = StepTimings(calls=[])
            auto, auto_tps = _decode_rate(target, draft, prompts, args.new_tokens, policy=policy, timings=auto_t)
            # the same again with the policy that run left (a service's policy lives across requests: its
            # first requests pay the measuring of each budget, later ones follow what it measured)
            warm, _ = _decode_rate(target, draft, prompts, args.new_tokens, policy=policy)
            service, _ = _decode_rate(target, draft, prompts, args.new_tokens, policy=policy,
                                      overlap=TwoBatchOverlap(0, target.device))
            rows.append({"bs": bs, "simulated_tau": tau, "measured_tau": round(measured_tau, 2),
                         "plain_tok_s": round(plain, 1), "spec_tok_s": round(spec, 1),
                         "speedup": round(spec / plain, 2), "auto_tok_s": round(auto, 1),
                         "auto_speedup": round(auto / plain, 2), "auto_tokens_per_step": round(auto_tps, 2),
                         "auto_warm_tok_s": round(warm, 1), "auto_warm_speedup": round(warm / plain, 2),
                         "auto_service_tok_s": round(service, 1), "auto_service_speedup": round(service / plain, 2),
                         "auto_rates": policy.summary(), "plain_split": _split(plain_t),
                         "spec_split": _split(spec_t),
                         "auto_split": _split(auto_t), "cuda_allocator": _allocator_counts()})
            print("SIMULATED", rows[-1], flush=True)
            rows[-1]["auto_history"] = policy.history  # per record: see SpeculationPolicy.record
            # the timed runs' calls (StepTimings.calls: speculative, requests, steps, seconds, requests ended)
            rows[-1].update(plain_calls=plain_t.calls, spec_calls=spec_t.calls, auto_calls=auto_t.calls)
    target.simulate_accept_len = 0.0
    res["SIMULATED_acceptance_rows"] = rows


def simulated_draft(target, config: str, backend: str, max_batch_size: int):
    """The 8B-shaped draft head `config` (chain of 6) beside `target`, set up as a draft service is before any
    timing: the verify shapes `auto` may send captured (a shape first met inside a row stalled its step for a whole
    ladder's capture: eighth pass, 4 steps of ~345 ms), then the start-up objects frozen out of the collector (a
    full collection, ~150-200 ms here, landed in one admission of 64 requests in ~8, and a row's timed run that met
    it read ~10% slow: seventeenth pass)."""
    opts = _opts(backend, dummy_weights=True, max_batch_size=max_batch_size, max_context=4096, num_pages=8192,
                 token_map=TOKEN_MAP)
    draft = build_draft(config, "llama3-8b", SpecConfig(6, 1, 6), opts, target.max_context)
    n = draft.spec.num_draft_tokens
    warm_verify_shapes(target, [n if b == FULL else b for b in budget_menu(n)], draft.spec.topk,
                       feature_layers_for(draft), target.cfg.vocab_size)
    freeze_start_up_objects()
    return draft


def plain_batches(res, args, target):
    """Plain decoding tokens/s at each batch size (8B shape, 256-token prompts): the baseline of `simulated`
    alone, e.g. to compare two settings of the target in two runs."""
    rows = []
    for bs in args.batch_sizes:
        prompts = [list(range(1000 + i, 1256 + i)) for i in range(bs)]
        timings = StepTimings()
        rate, _ = _decode_rate(target, None, prompts, args.new_tokens, timings=timings)
        rows.append({"bs": bs, "plain_tok_s": round(rate, 1), "plain_split": _split(timings)})
        print("PLAIN", rows[-1], flush=True)
    res["plain_rows"] = rows


def calibrated_policy(target, draft, max_batch_size: int) -> SpeculationPolicy:
    """A fresh `auto` policy seeded as the draft service seeds its own at start-up on a GPU (`engine/calibration.py`:
    every batch-size bucket up to `max_batch_size`)."""
    policy = SpeculationPolicy(budget_menu(draft.spec.num_draft_tokens))
    sched = Scheduler(target, draft, target.max_context, max_batch_size, feature_layers_for(draft), policy=policy,
                      plain_steps=DRAFT_GPU_PLAIN_STEPS, overlap=TwoBatchOverlap(0, target.device))
    calibrate(sched, policy, target.cfg.vocab_size, batch_sizes=batch_sizes_up_to(max_batch_size))
    return policy


def tiny(res, args):
    opts = _opts(args.backend, max_batch_size=max(args.batch_sizes), num_pages=8192)
    target = build_target(str(TINY / "target"), opts)
    from specdec.tokenizer import load_tokenizer

    tok = load_tokenizer(TINY / "target")
    lines = ["def f(x):\n"] * 32
    if args.prompts:
        lines = [json.loads(x)["prompt"] for x in Path(args.prompts).read_text().splitlines() if x.strip()]
    rows = []
    for kind, spec in (("draft", SpecConfig(5, 1, 5)), ("draft-eagle3", SpecConfig(5, 1, 5)),
                       ("draft", SpecConfig(6, 4, 16))):
        draft = build_draft(str(TINY / kind), str(TINY / "target"), spec, opts, target.max_context)
        for bs in args.batch_sizes:
            prompts = [tok.encode(p)[-256:] for p in lines[:bs]]
            n, reps = args.tiny_new_tokens, args.tiny_repeats
            plain, _ = _decode_rate(target, None, prompts, n, repeats=reps)
            rate, tau = _decode_rate(target, draft, prompts, n, repeats=reps)
            # `auto` as the draft service runs it on a GPU: plain calls of DRAFT_GPU_PLAIN_STEPS tokens, two in
            # flight (its scheduler always keeps a TwoBatchOverlap); plain decoding is the target's own loop
            service = {"plain_steps": DRAFT_GPU_PLAIN_STEPS, "overlap": TwoBatchOverlap(0, target.device)}
            # a fresh service's first requests: calibrated at start-up, nothing learned from requests yet
            cold_policy = calibrated_policy(target, draft, len(prompts))
            cold, cold_tps = _decode_rate(target, draft, prompts, n, policy=cold_policy, warm_up=False, **service)
            policy = SpeculationPolicy(budget_menu(spec.num_draft_tokens))
            auto, auto_tps = _decode_rate(target, draft, prompts, n, policy=policy, repeats=reps, **service)
            plain_again, _ = _decode_rate(target, None, prompts, n, repeats=reps)  # the drift during the row
            rows.append({"draft": kind, "spec": f"s{spec.num_steps}k{spec.topk}d{spec.num_draft_tokens}", "bs": bs,
                         "tau": round(tau, 2), "plain_tok_s": round(plain, 1),
                         "plain_again_tok_s": round(plain_again, 1), "spec_tok_s": round(rate, 1),
                         "speedup": round(rate / plain, 2), "auto_tok_s": round(auto, 1),
                         "auto_speedup": round(auto / plain, 2), "auto_tokens_per_step": round(auto_tps, 2),
                         "auto_cold_tok_s": round(cold, 1), "auto_cold_speedup": round(cold / plain, 2),
                         "auto_cold_tokens_per_step": round(cold_tps, 2), "auto_rates": policy.summary(),
                         "auto_cold_rates": cold_policy.summary()})
            print(rows[-1], flush=True)
    res["tiny_rows"] = rows


def hf(res, args):
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdec.models.presets import PRESETS

    cfg = LlamaConfig(**{k: v for k, v in PRESETS["llama3-8b"].items() if k != "architectures"})
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    ids = torch.arange(1000, 1512, device="cuda").unsqueeze(0)
    for label, kw in (("dynamic", {}), ("static", {"cache_implementation": "static"})):
        try:
            model.generate(ids, max_new_tokens=8, do_sample=False, **kw)
            n = args.new_tokens
            t, out = _sync_time(partial(model.generate, ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                        **kw))
            new = out.shape[1] - ids.shape[1]
            res[f"transformers_generate_{label}_tok_s_bs1"] = round(new / t, 1)
        except Exception as exc:  # noqa: BLE001
            res[f"transformers_generate_{label}_error"] = repr(exc)[:300]
    model = None
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_bench.json")
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--sections", default="floors,plain8b,profile,draft8b,simulated,tiny,hf")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--tiny-new-tokens", type=int, default=128)
    ap.add_argument("--tiny-repeats", type=int, default=3, help="timed runs per tiny-pair measurement (median)")
    ap.add_argument("--draft-config", default="llama3-8b-eagle1",
                    help="the 8B-shaped head of the simulated rows: llama3-8b-eagle1 (the target's 128k vocabulary) "
                         "or llama3-8b-eagle3 (a 32k draft vocabulary, three target layers as features)")
    ap.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                    help="the simulated rows' EAGLE-1 head proposes from N tokens only (a token map, --token-map; "
                         "random weights: the first N ids); 0 = the whole vocabulary")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only smoke-tests the script (tiny section)")
    args = ap.parse_args()
    global DEVICE, TOKEN_MAP
    DEVICE = args.device
    if args.draft_vocab:
        TOKEN_MAP = str(Path(args.out).with_suffix(".token_map.json"))
        write_token_map(range(args.draft_vocab), TOKEN_MAP)
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    res = {"gpu": gpu, "torch": torch.__version__, "args": vars(args)}
    sections = args.sections.split(",")
    bw, target = 4.0e12, None
    for name in sections:
        t0 = time.time()
        try:
            if name == "floors":
                bw = floors(res)
            elif name == "plain8b":
                target = plain8b(res, args, bw)
            elif name == "profile" and target is not None:
                profile8b(res, args, target)
            elif name == "draft8b" and target is not None:
                draft8b(res, args, target)
            elif name == "simulated" and target is not None:
                simulated(res, args, target)
            elif name == "plain" and target is not None:
                plain_batches(res, args, target)
            elif name == "hf":
                if target is not None:
                    del target
                    target = None
                    torch.cuda.empty_cache()
                hf(res, args)
            elif name == "tiny":
                tiny(res, args)
        except Exception:  # noqa: BLE001 - keep what the other sections measured
            res[f"{name}_error"] = traceback.format_exc()[-2000:]
        res[f"{name}_seconds"] = round(time.time() - t0, 1)
        Path(args.out).write_text(json.dumps(res, indent=1))
        print(name, "done", json.dumps({k: v for k, v in res.items() if not isinstance(v, list)})[:1500], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
