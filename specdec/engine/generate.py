"""In-process generation (no gRPC): the reference loop the services wrap, batched."""

from __future__ import annotations

from specdec.engine.adaptive import SpeculationPolicy
from specdec.engine.draft_engine import DraftEngine
from specdec.engine.overlap import TwoBatchOverlap
from specdec.engine.plain_steps import PLAIN_STEPS
from specdec.engine.requests import RUNNING, GenerationResult, StepTimings
from specdec.engine.scheduler import Scheduler
from specdec.engine.target_engine import TargetEngine
from specdec.sampling_params import SamplingParams


def feature_layers_for(draft: DraftEngine | None) -> tuple[int, ...]:
    """What the target must return for this draft: () = final normed hidden (EAGLE-1), else aux layer inputs."""
    if draft is None or draft.model.cfg.kind != "eagle3":
        return ()
    return draft.model.cfg.aux_layer_inputs


def generate(
    target: TargetEngine,
    draft: DraftEngine | None,
    prompts: list[list[int]],
    sampling: SamplingParams | list[SamplingParams],
    max_batch_size: int = 64,
    policy: SpeculationPolicy | None = None,
    timings: StepTimings | None = None,
    overlap: TwoBatchOverlap | None = None,
    plain_steps: int = PLAIN_STEPS,
) -> list[GenerationResult]:
    """Generate for every prompt; speculative when `draft` is given, plain decoding otherwise. With a `policy`
    (`--speculation auto`), each step speculates or decodes plainly, whichever measured faster. `timings`, if
    given, accumulates where the time went (admission, plain and speculative steps). With `overlap`, large
    batches run as two micro-batches in turn (worth it with draft and target on separate GPUs). `plain_steps`: tokens
    per request of a plain call (one host sync; see `specdec.engine.plain_steps`)."""
    params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    sched = Scheduler(target, draft, target.max_context, max_batch_size, feature_layers_for(draft), policy=policy,
                      timings=timings, overlap=overlap, plain_steps=plain_steps)
    results: dict[str, GenerationResult] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        rid = f"gen-{i}"
        sched.add(rid, prompt, p)
        results[rid] = GenerationResult(rid, len(prompt))
    try:
        _drive(sched, results)
    finally:
        sched.close()
    for res in results.values():
        assert res.finish_reason != RUNNING, res
    return [results[f"gen-{i}"] for i in range(len(prompts))]


def _drive(sched: Scheduler, results: dict[str, GenerationResult]) -> None:
    while sched.has_work:
        states = dict(sched.running)
        for ev in sched.step():
            res = results[ev.request_id]
            if ev.error is not None:
                raise ev.error
            res.tokens += ev.tokens
            if ev.from_verify:  # tokens committed per target step (several plain steps: one each)
                res.accept_lengths += [len(ev.tokens)] if ev.num_steps == 1 else [1] * ev.num_steps
            res.finish_reason = ev.finish_reason
            rid = ev.request_id
            state = states.get(rid) or sched.running.get(rid) or sched.ended.get(rid)
            if state is not None:
                res.num_verify_steps = state.num_verify_steps
                res.accepted_per_position = list(state.accepted_per_position)
                res.num_draft_tokens = state.num_draft_tokens
