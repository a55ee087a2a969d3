"""A long prompt prefilled in parts: one engine call per part of at most `prefill_chunk_tokens` tokens, each part
attending to the parts before it through the KV cache (the forward of a chain verify: new queries over a cached
prefix, causal among themselves).

Why: a prompt's prefill was one forward, as long as the prompt. On the target's engine thread nothing else runs
meanwhile, so every running stream stopped for it (an 8B shape's 8,000-token prompt: a few hundred milliseconds on
an H200, seconds on a CPU), and a step past `--engine-stall-seconds` marked the service stalled. The target service
runs a long prompt's parts as separate calls of its engine loop (`target_service.servicer`): Verify calls that
arrive meanwhile run between two parts, so a running stream waits for one part at most. In one process
(`prefill`) the parts run back to back: the step is as long, but the attention of one part is bounded.

`PrefillParts` is a part of `TargetEngine` (a mixin over its requests, KV cache and forward), kept in its own file.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specdec.attention import SeqAttention
from specdec.engine.device import engine_call
from specdec.engine.requests import PrefillInput, PrefillOutput, kept_feature_rows
from specdec.errors import InvalidInput, OutOfPages, UnknownRequest


@dataclass
class PromptInParts:
    inp: PrefillInput
    done: int = 0  # prompt tokens whose K/V are in the cache
    features: list[torch.Tensor] = field(default_factory=list)  # the kept feature rows of the parts so far


class PrefillParts:
    prefill_chunk_tokens: int  # 0: every prompt in one forward
    prefilling: dict[str, PromptInParts]  # admitted requests whose prompt is not all in the cache yet

    def in_parts(self, inp: PrefillInput) -> bool:
        """Is this prompt prefilled in parts (longer than one part)?"""
        return 0 < self.prefill_chunk_tokens < len(inp.prompt_ids)

    @engine_call
    def begin_prefill(self, inp: PrefillInput):
        """Admit the request (its KV pages, in its turn: `prefill`'s rules for one request); `prefill_part` then
        runs its prompt part by part. A verify naming it is refused until its last part has run. -> the admitted
        TargetRequest (what a caller that leaves releases: not a later request under the same id)."""
        rid = inp.request_id
        try:
            req = self._admit(inp)  # (refused, it holds nothing: a request running under the id is not its to end)
        except Exception as exc:
            if not isinstance(exc, OutOfPages):
                self.page_queue.leave([rid])
            raise
        self.page_queue.leave([rid])
        self.prefilling[rid] = PromptInParts(inp)
        return req

    @engine_call
    def prefill_part(self, request_id: str) -> PrefillOutput | None:
        """The next part of a request `begin_prefill` admitted: None while parts remain, its output after the last.
        A part that fails releases the request (nothing of it stays)."""
        part = self.prefilling.get(request_id)
        if part is None:
            raise UnknownRequest(f"request {request_id!r} has no prefill under way (released meanwhile?)")
        try:
            out = self._run_part(part)
        except Exception:
            self.prefilling.pop(request_id, None)
            if request_id in self.requests:
                self.release(request_id)
            raise
        if out is not None:
            self.prefilling.pop(request_id, None)
        return out

    def check_not_prefilling(self, request_ids) -> None:
        """A verify may not name a request whose prompt is still being prefilled."""
        if self.prefilling:
            rid = next((r for r in request_ids if r in self.prefilling), None)
            if rid is not None:
                raise InvalidInput(f"request {rid!r} is still being prefilled (its Prefill has not answered)")

    def _prefill_in_parts(self, inp: PrefillInput) -> PrefillOutput:
        """All of a long prompt's parts back to back (a caller in this process)."""
        self.begin_prefill(inp)
        out = None
        while out is None:
            out = self.prefill_part(inp.request_id)
        return out

    def _run_part(self, part: PromptInParts) -> PrefillOutput | None:
        inp = part.inp
        rid, total = inp.request_id, len(inp.prompt_ids)
        req = self.requests[rid]
        start, end = part.done, min(total, part.done + self.prefill_chunk_tokens)
        self.kv.resize(rid, end)
        ctx = self.kv.slots(rid, 0, end)
        hidden, aux = self._forward(inp.prompt_ids[start:end], torch.arange(start, end),
                                    [SeqAttention(ctx, end - start)], ctx[start:], [inp])
        part.done = req.kv_len = end
        req.named_at = time.monotonic()  # alive (`release_idle`) for as long as its parts run
        if inp.return_features:
            first = max(total - kept_feature_rows(total, inp.feature_rows), start)
            if first < end:  # a copy: the next part's forward reuses nothing of this one's
                part.features.append(self._features(req, hidden, aux, slice(first - start, end - start)))
        if end < total:
            return None
        token = self._pick(req, self.model.compute_logits(hidden[end - start - 1 : end - start]))[0]
        feats = torch.cat(part.features) if inp.return_features else None
        part.features = []
        kept, reason = self._commit_tokens(rid, req, [token])
        return PrefillOutput(rid, kept[0], feats, reason)
