"""DraftService over gRPC: streams the tokens of each request as the speculative loop accepts them."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from specdec.engine.draft_engine import DraftEngine
from specdec.engine.requests import RUNNING
from specdec.errors import InvalidInput, NotReady, SpecdecError
from specdec.rpc.errors import map_servicer_errors
from specdec.rpc.kv_stats import kv_stats
from specdec.rpc.metadata import left_status
from specdec.rpc.sampling_codec import sampling_from_proto
from specdec.rpc.target_codec import check_request_id, finish_to_proto
from specdec.serving.engine_loop import EngineLoop
from specdec.spec_params import TREE_CAP_FIELDS, asked_tree_shape, check_fits
from specdec.telemetry import bind_request_id
from specdec.tree import TreeCap
from specdec.v1 import common_pb2, draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)


@map_servicer_errors
class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.target_name = ""  # the target's GetModelInfo.model, once connected (was its address; the proto says name)
        self.engine: DraftEngine | None = None
        self.num_running = lambda: 0  # requests in the running batch (set with the scheduler)
        self.loop: EngineLoop | None = None
        self.max_context = 0
        self.vocab_size = 0
        self.metrics = None
        self.target_misfit: Callable[[], str | None] = lambda: None  # `TargetWatch.misfit` of a remote target

    def _check(self, request) -> tuple[str, list[int], object]:
        rid = check_request_id(request.request_id, chosen_by_client=True)
        prompt = list(request.prompt_ids)
        if not prompt:
            raise InvalidInput("prompt is empty")
        if len(prompt) >= self.max_context:
            raise InvalidInput(f"prompt has {len(prompt)} tokens; the draft's context length is {self.max_context} "
                               f"(at most {self.max_context - 1} prompt tokens; through the gateway a longer prompt "
                               f"that fits the target runs plainly)")
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidInput(f"prompt token id {bad} outside the vocabulary [0, {self.vocab_size})")
        sampling = sampling_from_proto(request.sampling if request.HasField("sampling") else None)
        sampling.validate(self.vocab_size)
        cap = self._tree_cap(request.spec) if request.HasField("spec") else None
        return rid, prompt, sampling, cap

    def _tree_cap(self, spec) -> TreeCap | None:
        """The request's own tree shape: each field it sets from 1 up to the service's (a smaller tree is the
        service's, pruned: `TreeCap.prune`); None where it asks for the service's own."""
        mine = self.engine.spec
        asked = asked_tree_shape(spec)
        check_fits(asked, [{f: getattr(mine, f) for f in TREE_CAP_FIELDS}], "this draft service")
        cap = TreeCap(*(asked.get(f, getattr(mine, f)) for f in TREE_CAP_FIELDS))
        return None if all(getattr(cap, f) == getattr(mine, f) for f in TREE_CAP_FIELDS) else cap

    async def Generate(self, request, context):
        outcome = "CANCELLED"  # unless the stream ends or fails: the client left
        try:
            async with contextlib.aclosing(self._generate(request)) as responses:
                async for msg in responses:
                    yield msg
            outcome = "OK"  # observed with its latencies by `_generate`
        except SpecdecError as exc:
            outcome = exc.status
            raise
        except Exception:
            outcome = "INTERNAL"
            raise
        finally:
            if outcome == "CANCELLED":  # or its deadline passed: grpc cancels the handler either way
                outcome = left_status(context).name
            if outcome != "OK" and self.metrics is not None:
                self.metrics.observe_request(outcome)

    async def _generate(self, request):
        rid, prompt, sampling, cap = self._check(request)
        misfit = self.target_misfit()
        if misfit is not None:
            # (before, taken and failed part way, INVALID_ARGUMENT from the target: QA)
            raise NotReady(f"{misfit}: this draft takes no requests until its target fits it (it reports NOT_SERVING)")
        with bind_request_id(rid):
            t0 = time.perf_counter()
            ttft, n, steps, per_pos = None, 0, 0, []
            finished = False
            try:
                async for ev in self.loop.stream(rid, prompt, sampling, cap):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    n += len(ev.tokens)
                    if ev.from_verify:
                        steps += ev.num_steps
                        per_pos += [0] * max(0, ev.num_accepted_drafts - len(per_pos))
                        for i in range(ev.num_accepted_drafts):
                            per_pos[i] += 1
                    msg = draft_pb2.DraftServiceGenerateResponse(token_ids=ev.tokens)
                    if ev.finish_reason != RUNNING:
                        total = time.perf_counter() - t0
                        tau = (n - 1) / steps if steps else 0.0
                        finished = True
                        msg.final.CopyFrom(draft_pb2.GenerationStats(
                            finish_reason=finish_to_proto(ev.finish_reason), prompt_tokens=len(prompt),
                            completion_tokens=n, num_verify_steps=steps, tau=tau, accepted_per_position=per_pos,
                            time_to_first_token_s=ttft, total_s=total))
                        log.info("done: %d prompt + %d new tokens, tau %.2f, ttft %.3f s, %.3f s (%s)", len(prompt), n,
                                 tau, ttft, total, ev.finish_reason,
                                 extra={"prompt_tokens": len(prompt), "completion_tokens": n, "tau": round(tau, 3),
                                        "num_verify_steps": steps, "accepted_per_position": per_pos,
                                        "ttft_s": round(ttft, 4), "total_s": round(total, 4),
                                        "finish_reason": ev.finish_reason})
                        if self.metrics is not None:
                            self.metrics.observe_request("OK", ttft_s=ttft, tpot_s=(total - ttft) / max(1, n - 1),
                                                         e2e_s=total)
                    yield msg
            finally:
                if self.metrics is not None:  # finished or not: what it generated was generated
                    self.metrics.count_tokens(len(prompt), n)
                if not finished:  # cancelled, past its deadline or failed: its line too (the status is the caller's)
                    total = time.perf_counter() - t0
                    log.info("ended early: %d prompt + %d new tokens, %.3f s", len(prompt), n, total,
                             extra={"prompt_tokens": len(prompt), "completion_tokens": n, "num_verify_steps": steps,
                                    "total_s": round(total, 4), "finish_reason": "early"})

    async def Abort(self, request, context):
        rid = check_request_id(request.request_id)
        return draft_pb2.AbortResponse(found=await self.loop.abort(rid))

    async def GetModelInfo(self, request, context):
        cfg, spec = self.engine.model.cfg, self.engine.spec
        return draft_pb2.DraftServiceGetModelInfoResponse(
            model=self.model_name, architecture=cfg.architecture, draft_vocab_size=cfg.draft_vocab_size,
            target=self.target_name,
            spec=common_pb2.SpecParams(num_steps=spec.num_steps, topk=spec.topk,
                                       num_draft_tokens=spec.num_draft_tokens),
            kv=kv_stats(self.engine.kv),
            num_running=self.num_running(),
            max_context_len=self.max_context,
        )
