"""The target side: prefill, batched tree verification and plain decoding over a paged KV cache.

Engines are synchronous and single-threaded; the service runs them on a worker thread.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specdec.attention import AttentionBatch, SeqAttention, make_backend, triton_decode
from specdec.attention.graph_backend import GraphCaptureError
from specdec.engine.device import engine_call, resolve_device
from specdec.engine.finish import cut_at_finish, length_room
from specdec.engine.host_features import FeatureStager
from specdec.engine.page_queue import PageQueue
from specdec.engine.plain_steps import (
    MAX_PLAIN_STEPS,
    check_plain_steps,
    last_feature_rows,
    run_plain_steps,
    split_features,
    step_features_into,
)
from specdec.engine.prefill_parts import PrefillParts, PromptInParts
from specdec.engine.requests import (
    RUNNING,
    PrefillInput,
    PrefillOutput,
    VerifyInput,
    VerifyOutput,
    kept_feature_rows,
)
from specdec.engine.verify_features import VerifyFeatures, one_layer_set
from specdec.errors import DuplicateRequest, InvalidInput, OutOfOrder, OutOfPages, UnknownRequest
from specdec.host_copy import to_device
from specdec.kv_cache import PagedKVCache
from specdec.models.llama import LlamaForCausalLM
from specdec.sampling import make_generator, sample, target_probs
from specdec.sampling_params import SamplingParams
from specdec.tree import ancestor_mask, depths, is_chain, max_depth, trees_valid, validate_tree
from specdec.verify import verify_greedy, verify_simulated, verify_stochastic

# Requests the target finished itself (stop token, length) whose ids a later plain call may still name: a draft
# keeps two plain calls in flight (`TwoBatchOverlap`), so the second was sent before the first's reply said that
# a request finished. Remembered with their finish reason, the oldest forgotten first.
FINISHED_MEMORY = 4096


@dataclass
class TargetRequest:
    sampling: SamplingParams
    generator: torch.Generator
    feature_layers: tuple[int, ...]
    prompt_len: int
    kv_len: int  # committed tokens with K/V in the cache
    root: int  # last committed token, not yet in the cache
    num_generated: int
    feature_wire: str = ""  # kept for the service: how its features travel (PrefillInput.feature_wire)
    features: bool = True  # its verify outputs carry features (False: plain Generate, no draft reads them)
    simulation: random.Random | None = None  # draws of `--simulate-accept-len` (seeded from `generator`)
    named_at: float = field(default_factory=time.monotonic)  # the last prefill or verify naming it (`release_idle`)


MAX_FEATURE_LAYERS = 8  # layers a request's features may concatenate (EAGLE-3 reads 3)


class TargetEngine(PrefillParts, VerifyFeatures):
    batches_prefill = True  # prefill() runs many requests in one forward (the scheduler groups admissions)

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_pages: int,
        page_size: int = 16,
        attention_backend: str = "torch",
        max_context: int | None = None,
        max_draft_tokens: int = 64,
        device: str | torch.device = "cpu",
        max_batch_size: int = 64,
        simulate_accept_len: float = 0.0,
        cuda_graphs: bool = False,
        prefill_chunk_tokens: int = 0,
    ):
        cfg = model.cfg
        self.simulate_accept_len = simulate_accept_len  # benchmarking only: outputs are not the target's
        self.model, self.cfg, self.device = model, cfg, resolve_device(device)
        dtype = next(model.parameters()).dtype
        self.kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages, page_size, dtype, device)
        self.page_queue = PageQueue()  # requests refused for lack of pages, in turn across every caller
        self.backend = make_backend(attention_backend, self.kv, cfg.num_heads, triton_decode.MAX_QUERIES,
                                    triton_trees=True)
        self.max_context = min(max_context or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.max_draft_tokens = max_draft_tokens
        self.requests: dict[str, TargetRequest] = {}
        self.finished: OrderedDict[str, str] = OrderedDict()  # id -> finish reason (`FINISHED_MEMORY`)
        self.prefill_chunk_tokens = prefill_chunk_tokens  # a longer prompt is prefilled in parts (`PrefillParts`)
        self.prefilling: dict[str, PromptInParts] = {}
        self._stager: FeatureStager | None = None  # `features_on_host` copies (made at the first)
        self.graphs = None
        if cuda_graphs:
            from specdec.engine.cuda_graphs import TargetGraphs

            scratch = self.kv.set_aside(-(-(max_draft_tokens + 1) // page_size))  # padding rows live here
            self.graphs = TargetGraphs(model, self.kv, scratch, self.max_context, max_batch_size)

    @property
    def _reserved(self) -> int:
        """KV pages promised to running requests."""
        return self.kv.reserved_by_requests

    # ---- admission --------------------------------------------------------------------------------------
    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.cfg.eos_token_ids

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidInput("prompt is empty")
        self.check_prompt_length(len(prompt_ids))
        bad = next((t for t in prompt_ids if not 0 <= t < self.cfg.vocab_size), None)
        if bad is not None:
            raise InvalidInput(f"prompt token id {bad} outside the vocabulary [0, {self.cfg.vocab_size})")

    def check_prompt_length(self, n: int) -> None:
        """A prompt of `n` tokens fits the context (checked on a message's length before its ids are read)."""
        if n >= self.max_context:
            raise InvalidInput(f"prompt has {n} tokens; the context length is {self.max_context} "
                               f"(at most {self.max_context - 1} prompt tokens)")

    def check_verify_size(self, num_trees: int) -> None:
        """A Verify of `num_trees` requests could name running ones: each holds a KV page at least (checked on the
        message before its trees are read: two million empty trees took ~15 s to read on the service's event loop,
        holding every other call: QA)."""
        if num_trees > self.kv.num_total_pages:
            raise InvalidInput(f"Verify names {num_trees} requests; this target holds at most "
                               f"{self.kv.num_total_pages} at once (a KV page each)")

    @property
    def _tree_slots(self) -> int:
        """Slots a request holds past its tokens: one full tree's (and a plain chunk's run past its limit)."""
        return self.max_draft_tokens + 1

    def _max_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """Worst case: every generated token plus one full tree of temporary slots."""
        return min(prompt_len + params.max_new_tokens, self.max_context) + self._tree_slots

    def _admit(self, inp: PrefillInput) -> TargetRequest:
        if inp.request_id in self.requests:
            raise DuplicateRequest(f"request {inp.request_id!r} is already running")
        self.validate_prompt(inp.prompt_ids)
        inp.sampling.validate(self.cfg.vocab_size)
        bad = [i for i in inp.feature_layers if not 0 <= i <= self.cfg.num_layers]
        if bad:
            raise InvalidInput(f"feature layer {bad[0]} outside [0, {self.cfg.num_layers}]")
        if len(inp.feature_layers) > MAX_FEATURE_LAYERS:
            # (a layer may come twice: EAGLE-3's default layers (2, L // 2, L - 3) repeat on targets of under 6
            # layers; but before, any number was taken, each a hidden size of features for every token: QA)
            raise InvalidInput(f"{len(inp.feature_layers)} feature layers asked for; at most {MAX_FEATURE_LAYERS}")
        if inp.feature_rows < 0:
            raise InvalidInput(f"feature_rows {inp.feature_rows} is negative (0: every prompt token's features)")
        self._reserve(inp, self._max_tokens(len(inp.prompt_ids), inp.sampling))
        self.finished.pop(inp.request_id, None)
        req = TargetRequest(inp.sampling, make_generator(inp.sampling), tuple(inp.feature_layers),
                            len(inp.prompt_ids), 0, -1, 0, inp.feature_wire, inp.return_features)
        self.requests[inp.request_id] = req
        return req

    def _reserve(self, inp: PrefillInput, max_tokens: int) -> None:
        """The request's KV pages, in its turn (`page_queue`): refused (OutOfPages) while an earlier request
        waits for pages, whichever caller sent it, or while the pool cannot hold it. Refused, it keeps a place
        in the queue if its caller will ask again (`queue_for_pages`). One no pool could hold is refused first
        (InvalidInput: it would hold up the others for its whole wait). Places of requests admitted already (with
        it, in the same call: they leave the queue once it succeeds) do not count as waiting before it."""
        rid = inp.request_id
        self.kv.check_could_hold(max_tokens, fixed=len(inp.prompt_ids) + self._tree_slots)
        ahead = self.page_queue.ahead(rid, besides=self.requests)
        try:
            if ahead:
                raise OutOfPages(f"KV pool full: {ahead} earlier request{'s' * (ahead > 1)} wait for pages")
            self.kv.add(rid, max_tokens)
        except OutOfPages:
            if inp.queue_for_pages:
                self.page_queue.wait(rid)
            raise

    def hold_places(self, inputs: list[PrefillInput]) -> None:
        """Places in the page queue, in this order, for a caller's requests that wait behind its first one refused
        for lack of pages (the caller asks again for that one only; its place is refreshed, the others join the
        end). Without them a plain `Generate` waiting second in the target's own queue was passed by every later
        request of a remote draft, whose Prefills each hold a place (QA: one timed out behind later ones)."""
        for inp in inputs:
            if inp.request_id not in self.requests and \
                    self.kv.could_ever_hold(self._max_tokens(len(inp.prompt_ids), inp.sampling)):
                self.page_queue.wait(inp.request_id)

    def release(self, request_id: str) -> None:
        """Free a request's pages; a request waiting for pages (in the page queue) leaves the queue instead: its
        caller gave up on it (a client that left, a queue wait that ran out), and the requests behind it need not
        wait for its place to lapse."""
        self.prefilling.pop(request_id, None)
        if self.requests.pop(request_id, None) is None:
            if request_id in self.page_queue:
                self.page_queue.leave([request_id])
                return
            raise UnknownRequest(f"unknown request id {request_id!r}")
        self.kv.release(request_id)

    def mark_all_named(self) -> None:
        """Count every request as named now (`release_idle` starts their idle time over)."""
        now = time.monotonic()
        for req in self.requests.values():
            req.named_at = now

    def release_idle(self, idle_s: float) -> list[str]:
        """Release the requests that no prefill or verify has named for `idle_s` seconds: their draft is gone
        (killed with its gateway, or it gave up on a call that timed out and could not release them), and they
        would hold their pages and their ids for good. -> their ids (a later call naming one gets NOT_FOUND)."""
        now = time.monotonic()
        idle = [rid for rid, req in self.requests.items() if now - req.named_at > idle_s]
        for rid in idle:
            self.release(rid)
        return idle

    # ---- steps --------------------------------------------------------------------------------------------
    @engine_call
    def prefill(self, inputs: list[PrefillInput]) -> list[PrefillOutput]:
        """All or nothing: if any input is refused or the forward fails, none of them stays admitted.

        A refused group is asked for again one request at a time (`Admission`, the target's Prefill RPCs): the
        requests it put in the page queue leave it, so they queue in that order; those waiting before keep their
        place. A single request keeps its place only when it was refused for lack of pages. A single prompt longer
        than `prefill_chunk_tokens` runs in parts (`PrefillParts`)."""
        if len(inputs) == 1 and self.in_parts(inputs[0]):
            return [self._prefill_in_parts(inputs[0])]
        admitted: list[PrefillInput] = []
        fresh = [inp.request_id for inp in inputs if inp.request_id not in self.page_queue]
        try:
            for inp in inputs:
                self._admit(inp)
                admitted.append(inp)
            outputs = self._prefill_admitted(inputs)
        except Exception as exc:
            for inp in admitted:
                if inp.request_id in self.requests:
                    self.release(inp.request_id)
            if len(inputs) > 1:
                self.page_queue.leave(fresh)
            elif not isinstance(exc, OutOfPages):
                self.page_queue.leave([inputs[0].request_id])
            raise
        self.page_queue.leave(inp.request_id for inp in inputs)
        return outputs

    def _prefill_admitted(self, inputs: list[PrefillInput]) -> list[PrefillOutput]:
        ids, pos, seqs, slots = [], [], [], []
        for inp in inputs:
            n = len(inp.prompt_ids)
            self.kv.resize(inp.request_id, n)
            s = self.kv.slots(inp.request_id, 0, n)
            ids += inp.prompt_ids
            pos.append(torch.arange(n))
            seqs.append(SeqAttention(s, n))
            slots.append(s)
        hidden, aux = self._forward(ids, torch.cat(pos), seqs, torch.cat(slots), inputs)
        outputs, start = [], 0
        for inp in inputs:
            n = len(inp.prompt_ids)
            req = self.requests[inp.request_id]
            req.kv_len = n
            last = hidden[start + n - 1 : start + n]
            token = self._pick(req, self.model.compute_logits(last))[0]
            first = start + n - kept_feature_rows(n, inp.feature_rows)
            feats = self._features(req, hidden, aux, slice(first, start + n)) if inp.return_features else None
            toks, reason = self._commit_tokens(inp.request_id, req, [token])
            outputs.append(PrefillOutput(inp.request_id, toks[0], feats, reason))
            start += n
        return outputs

    @engine_call
    def verify(self, inputs: list[VerifyInput], plain_steps: int = 1, feature_rows: int = 0,
               features_on_host: bool = False) -> list[VerifyOutput]:
        """One target forward over the trees of several requests; commits the accepted paths. With empty trees,
        `plain_steps` > 1 runs that many plain decode steps (`specdec.engine.plain_steps`). `feature_rows` > 0:
        each output carries the features of its last that many tokens only. `features_on_host`: a tree verify's
        features may come back in host memory, copied while the logits are computed (`engine.host_features`:
        when staging is on and takes the batch; else on the device as always)."""
        check_plain_steps(inputs, plain_steps, feature_rows)
        gone = {inp.request_id for inp in inputs if inp.request_id not in self.requests and
                inp.request_id in self.finished}
        if gone:
            return self._verify_past_finish(inputs, gone, plain_steps, feature_rows, features_on_host)
        self._named(inputs)
        if plain_steps == 1:
            return last_feature_rows(self._verify_once(inputs, features_on_host), feature_rows)
        self._check_batch(inputs)
        if self.simulate_accept_len or all(self.requests[i.request_id].sampling.greedy for i in inputs):
            outputs = run_plain_steps(lambda live, k: self._plain_chunk(live, k, feature_rows), inputs,
                                      plain_steps, self._plain_limits)
        else:
            outputs = run_plain_steps(lambda live, _k: self._verify_checked(live), inputs, plain_steps)  # host draws
        return last_feature_rows(outputs, feature_rows)

    def _named(self, inputs: list[VerifyInput]) -> None:
        """The requests a call names are alive (`release_idle`). Refuse (before anything runs) a call that
        continues a request from another point than the target's: e.g. the second of two pipelined plain calls
        reaching the engine before the first. Inputs with `num_generated` 0 are not checked; unknown ids are left
        to `_check_batch`. A count no call can carry (negative, or past the request's budget by more than a call
        in flight could add) is INVALID_ARGUMENT, not ABORTED, which a caller sends again (QA)."""
        now = time.monotonic()
        for inp in inputs:
            req = self.requests.get(inp.request_id)
            if inp.num_generated < 0:
                raise InvalidInput(f"num_generated {inp.num_generated} of request {inp.request_id!r} is negative "
                                   f"(0: not checked)")
            if req is None:
                continue
            req.named_at = now
            most = req.sampling.max_new_tokens + max(MAX_PLAIN_STEPS, self.max_draft_tokens + 1)
            if inp.num_generated > most:
                raise InvalidInput(f"num_generated {inp.num_generated} of request {inp.request_id!r} is past "
                                   f"anything it can reach ({req.sampling.max_new_tokens} new tokens at most)")
            if inp.num_generated and inp.num_generated != req.num_generated:
                raise OutOfOrder(f"request {inp.request_id!r} has generated {req.num_generated} tokens; the call "
                                 f"continues from {inp.num_generated} (sent ahead of the call before it?)")

    def _verify_past_finish(self, inputs: list[VerifyInput], gone: set[str], plain_steps: int,
                            feature_rows: int, features_on_host: bool = False) -> list[VerifyOutput]:
        """A plain call (empty trees) naming requests that an earlier call finished (`gone`): each of those gets an
        empty output with its finish reason, the others run. Trees for a finished request are still refused."""
        if any(inp.draft_tokens for inp in inputs):
            raise UnknownRequest(f"request {sorted(gone)[0]!r} has finished (only a plain call may still name it)")
        live = [inp for inp in inputs if inp.request_id not in gone]
        ran = ({out.request_id: out for out in self.verify(live, plain_steps, feature_rows, features_on_host)}
               if live else {})
        return [ran[inp.request_id] if inp.request_id in ran else
                VerifyOutput(inp.request_id, [], 0, None, self.finished[inp.request_id]) for inp in inputs]

    def _check_batch(self, inputs: list[VerifyInput]) -> None:
        self.check_not_prefilling(inp.request_id for inp in inputs)
        reqs = [self.requests.get(inp.request_id) for inp in inputs]
        if (None not in reqs and len({inp.request_id for inp in inputs}) == len(inputs)
                and trees_valid([(inp.draft_tokens, inp.parents) for inp in inputs], self.cfg.vocab_size,
                                self.max_draft_tokens)
                and all(req.kv_len + max_depth(inp.parents) < self.max_context
                        for inp, req in zip(inputs, reqs, strict=True) if inp.draft_tokens)):
            return
        for inp in inputs:  # something is wrong: find the first bad input and say what
            req = self._get(inp.request_id)
            validate_tree(inp.draft_tokens, inp.parents, self.cfg.vocab_size, self.max_draft_tokens)
            if inp.draft_tokens and req.kv_len + max_depth(inp.parents) >= self.max_context:
                raise InvalidInput(f"tree of request {inp.request_id!r} reaches past the context length")
        if len({inp.request_id for inp in inputs}) != len(inputs):
            raise InvalidInput("a request id appears twice in one verify batch")

    def _verify_once(self, inputs: list[VerifyInput], features_on_host: bool = False) -> list[VerifyOutput]:
        self._check_batch(inputs)
        return self._verify_checked(inputs, features_on_host)

    def _verify_checked(self, inputs: list[VerifyInput], features_on_host: bool = False) -> list[VerifyOutput]:
        """One forward over inputs that `_check_batch` accepted (a live subset of them stays accepted)."""
        shapes = {tuple(inp.parents) for inp in inputs}
        if len(shapes) == 1 and is_chain(next(iter(shapes))):  # chains of one length (or plain steps): causal
            n = len(inputs[0].draft_tokens) + 1
            rows = [n] * len(inputs)
            reqs = [self.requests[inp.request_id] for inp in inputs]
            starts = [req.kv_len for req in reqs]
            for inp, start in zip(inputs, starts, strict=True):
                self.kv.resize(inp.request_id, start + n)
            ids = [t for inp, req in zip(inputs, reqs, strict=True) for t in (req.root, *inp.draft_tokens)]
            positions = [s + i for s in starts for i in range(n)]  # a list: no tensor work on the host
            hidden, aux = self._forward_causal(ids, positions, inputs, starts, n)
        else:
            hidden, aux, rows = self._forward_trees(inputs)
        staged = self._stage_features(inputs, hidden, aux) if features_on_host else None
        logits = self.model.compute_logits(hidden)  # [num_tokens, vocab]
        # greedy (and simulated) acceptance reads the whole batch's argmax in one host sync
        greedy = self.simulate_accept_len or any(self.requests[i.request_id].sampling.greedy for i in inputs)
        top1 = logits.argmax(-1).tolist() if greedy else None
        verdicts, committed, start = [], [], 0
        for inp, n in zip(inputs, rows, strict=True):
            verdict = self._verdict(inp, logits[start : start + n], top1[start : start + n] if top1 else None)
            verdicts.append(verdict)
            committed.append([0] + verdict.accepted)  # tree rows whose K/V stay: root, then the accepted path
            start += n
        feats = self._batch_features(inputs, rows, committed, hidden, aux, staged)
        return [self._accept(inp, v, c, f) for inp, v, c, f in zip(inputs, verdicts, committed, feats, strict=True)]

    def _forward_trees(self, inputs: list[VerifyInput]):
        """The forward of a verify whose trees differ in shape or are not chains: a tree mask per request.
        (hidden, aux, tree rows per request)"""
        ids, pos, seqs, slots, rows = [], [], [], [], []
        for inp in inputs:
            req = self.requests[inp.request_id]
            n = len(inp.draft_tokens) + 1
            self.kv.resize(inp.request_id, req.kv_len + n)
            ctx = self.kv.slots(inp.request_id, 0, req.kv_len + n)
            ids += [req.root] + list(inp.draft_tokens)
            pos += [req.kv_len] + [req.kv_len + d for d in depths(inp.parents)]  # one tensor for the batch below
            # a chain's tree mask is causal: no mask to build, pack and apply
            mask = None if is_chain(inp.parents) else ancestor_mask(inp.parents)
            seqs.append(SeqAttention(ctx, n, mask))
            slots.append(ctx[req.kv_len :])
            rows.append(n)
        hidden, aux = self._forward(ids, torch.tensor(pos), seqs, torch.cat(slots), inputs, graphable=True)
        return hidden, aux, rows

    def _verdict(self, inp: VerifyInput, logits, top1: list[int] | None):
        req = self.requests[inp.request_id]
        tokens, parents = list(inp.draft_tokens), list(inp.parents)
        if self.simulate_accept_len:
            if req.simulation is None:
                req.simulation = random.Random(req.generator.initial_seed())
            return verify_simulated(tokens, parents, top1, self.simulate_accept_len, req.simulation)
        if req.sampling.greedy:
            return verify_greedy(tokens, parents, top1)
        return verify_stochastic(tokens, parents, _host_probs(logits, req.sampling), req.generator)

    def _accept(self, inp: VerifyInput, verdict, committed_rows: list[int], feats) -> VerifyOutput:
        rid, req = inp.request_id, self.requests[inp.request_id]
        new_tokens = [inp.draft_tokens[a - 1] for a in verdict.accepted] + [verdict.bonus]
        self.kv.move(rid, [req.kv_len + r for r in committed_rows], req.kv_len)
        req.kv_len += len(committed_rows)
        self.kv.resize(rid, req.kv_len)  # frees the slots of rejected nodes
        kept, reason = self._commit_tokens(rid, req, new_tokens)
        num_acc = min(len(verdict.accepted), len(kept))
        if feats is not None and len(kept) < len(new_tokens):  # cut at a stop token or a length limit
            feats = feats[: len(kept)]
        return VerifyOutput(rid, kept, num_acc, feats, reason)

    def _commit_tokens(self, rid: str, req: TargetRequest, new_tokens: list[int]) -> tuple[list[int], str]:
        total = req.prompt_len + req.num_generated
        kept, reason = cut_at_finish(new_tokens, req.num_generated, total, req.sampling, self.eos_ids,
                                     self.max_context)
        req.num_generated += len(kept)
        req.root = kept[-1]
        if reason != RUNNING:
            self.release(rid)
            self.finished[rid] = reason
            if len(self.finished) > FINISHED_MEMORY:
                self.finished.popitem(last=False)
        return kept, reason

    def _plain_limits(self, rid: str) -> tuple[int, int]:
        """(room, wanted) of a request for `run_plain_steps`: the steps its pages may take in one chunk (its room in
        the context, and up to its reservation past max_new_tokens: the slots of one tree, `_max_tokens`), and the
        tokens it may still generate. A chunk runs past a request's max_new_tokens while others want more (the
        extra steps are dropped like those past a stop token): one cut short there split the call in two, with a
        host sync and an unhidden plan between (at 128 requests of an 8B shape a 4-step call in which 8 requests
        ended took 37.5 ms against 32, and fed the policy a slow plain rate; H200, sessions 16-17)."""
        req = self.requests[rid]
        total = req.prompt_len + req.num_generated
        wanted = length_room(req.sampling, req.num_generated, total, self.max_context)
        return min(wanted + self.max_draft_tokens, self.max_context - total), wanted

    def _plain_chunk(self, inputs: list[VerifyInput], k: int, feature_rows: int = 0) -> list[VerifyOutput]:
        """k greedy plain decode steps of every request with one host sync: each step's argmax stays on the device
        as the next step's input, so the host plans step i + 1 while the GPU runs step i. k is at most any
        request's room (`_plain_limits`), so no step runs past the context; tokens after a stop token or past
        max_new_tokens are dropped with the request's pages when it is released. `feature_rows` > 0: a request
        that runs on through the chunk gets the features of its last that many steps only, and only those steps
        copy theirs (one view per request, cut once for the batch: 128 slices per call cost ~0.25 ms of host time
        while the GPU waits); one that finishes in it gets none (a finished result carries no rows: the protocol's
        `num_feature_rows`). Every step copied its features before, an EAGLE-3 draft's three layers each: one H200
        run read that draft's 16-step plain calls at 0.48 ms a step against EAGLE-1's 0.29 on the tiny target; an
        A/B of the two codes on another H200 measured no difference beyond its run-to-run noise (session 31)."""
        reqs = [self.requests[inp.request_id] for inp in inputs]
        for inp, req in zip(inputs, reqs, strict=True):
            self.kv.resize(inp.request_id, req.kv_len + k)
        starts = torch.tensor([req.kv_len for req in reqs])
        ids: list[int] | torch.Tensor = [req.root for req in reqs]
        picked, feats, taken, chunk = [], [], None, None
        wanted = any(r.features for r in reqs)  # plain Generate: none, and no per-step feature work at all
        uniform = one_layer_set(reqs)
        first = k - kept_feature_rows(k, feature_rows)  # the first step whose features a running request gets
        for i in range(k):
            positions = starts + i
            if taken is not None:
                taken.synchronize()  # the GPU holds step i - 1's inputs: the planner's host buffers are free again
            taken = torch.cuda.Event() if self.device.type == "cuda" else None
            # a step whose features no request reads (all of them without a draft's features, or before `first`)
            # returns no aux layers (EAGLE-3's): the plain decode graph, no per-step aux work
            hidden, aux = self._forward_causal(ids, positions, inputs, positions.tolist(), 1, taken,
                                               aux=wanted and (not uniform or i >= first))
            ids = self.model.compute_logits(hidden).argmax(-1)
            picked.append(ids)
            if uniform and i >= first:  # row r of the step is request r's: one copy per step into [B, k - first, F]
                chunk = step_features_into(chunk, i - first, k - first, reqs[0].feature_layers, hidden, aux,
                                           len(reqs))
            elif wanted and not uniform:  # some requests want none, or the batch mixes feature layers (a uniform
                # batch's earlier steps copy nothing: each of its requests gets only its last steps' rows)
                feats.append(self._batch_features(inputs, [1] * len(inputs), [[0]] * len(inputs), hidden, aux))
        tokens = torch.stack(picked, 1).tolist()  # the chunk's one host sync
        outputs = []
        tails = chunk.unbind(0) if chunk is not None else None
        for r, (inp, req) in enumerate(zip(inputs, reqs, strict=True)):
            req.kv_len += k
            kept, reason = self._commit_tokens(inp.request_id, req, tokens[r])
            rows = split_features(feats, r, len(kept)) if feats else None
            if chunk is not None and len(kept) == k:
                rows = tails[r]
            elif chunk is not None:  # it finished in the chunk: its rows when the chunk copied them all
                rows = None if first else chunk[r, : len(kept)]
            outputs.append(VerifyOutput(inp.request_id, kept, 0, rows, reason))
        return outputs

    @torch.inference_mode()
    def prompt_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """Logits at every prompt position (no state kept): scoring, near-tie checks and reference tests.
        # [len(prompt_ids), vocab] float32"""
        self.validate_prompt(prompt_ids)
        rid = f"__score_{id(prompt_ids)}"
        n = len(prompt_ids)
        self.kv.add(rid)
        try:
            self.kv.resize(rid, n)
            slots = self.kv.slots(rid, 0, n)
            batch = self.backend.plan(AttentionBatch([SeqAttention(slots, n)], slots))
            ids = to_device(prompt_ids, self.device)
            out = self.model(ids, torch.arange(n, device=self.device), self.backend, batch)
            return self.model.compute_logits(out.hidden)
        finally:
            self.kv.release(rid)

    # ---- helpers ------------------------------------------------------------------------------------------
    def _get(self, rid: str) -> TargetRequest:
        req = self.requests.get(rid)
        if req is None:
            raise UnknownRequest(f"unknown request id {rid!r}")
        return req

    def _forward_causal(self, ids, positions: torch.Tensor | list[int], inputs, starts: list[int], n: int,
                        inputs_taken=None, aux: bool = True):
        """`_forward` for causal sequences of n new tokens each (chains, plain steps), request i's at positions
        starts[i] .. starts[i] + n - 1 (pages already grown to hold them): a captured forward reads the requests'
        page lists; the eager one gets slot tensors. `aux` False: none of the features' layer outputs (a plain
        step whose features no request reads)."""
        layers = self._aux_layers(inputs) if aux else ()
        if self.graphs is not None and self.graphs.usable(len(inputs), n, layers, True):
            pages = [self.kv.table(inp.request_id).pages for inp in inputs]
            try:
                hidden, aux_cat = self.graphs.run_causal(ids, positions, pages, [s + n for s in starts], n, layers,
                                                         inputs_taken)
                return hidden, self._split_aux(aux_cat, layers)
            except GraphCaptureError:
                pass  # logged by the graphs; this shape runs eagerly from now on
        ctxs = [self.kv.slots(inp.request_id, 0, s + n) for inp, s in zip(inputs, starts, strict=True)]
        seqs = [SeqAttention(ctx, n) for ctx in ctxs]
        write = torch.cat([ctx[s:] for ctx, s in zip(ctxs, starts, strict=True)])
        return self._forward(ids, positions, seqs, write, inputs, inputs_taken=inputs_taken, layers=layers)

    def _forward(self, ids, positions, seqs, write_slots, inputs, graphable: bool = False, inputs_taken=None,
                 layers: tuple[int, ...] | None = None):
        """hidden [T, H] and aux {layer: [T, H]}. `ids`: a list or a device tensor. `inputs_taken` (a CUDA event)
        is recorded once the forward's inputs and plan are on the GPU, before it runs. `layers`: the aux layers
        returned (None: those the inputs' requests read)."""
        layers = self._aux_layers(inputs) if layers is None else layers
        n = seqs[0].num_q
        hidden = None
        causal = all(s.tail_mask is None for s in seqs)
        if graphable and self.graphs is not None and all(s.num_q == n for s in seqs) and \
                self.graphs.usable(len(seqs), n, layers, causal):
            try:
                hidden, aux_cat = self.graphs.run(ids, positions, seqs, write_slots, n, layers, causal,
                                                  inputs_taken)
            except GraphCaptureError:
                hidden = None  # logged by the graphs; this shape runs eagerly from now on
        if hidden is None:
            batch = self.backend.plan(AttentionBatch(seqs, write_slots))
            ids, positions = to_device(ids, self.device), to_device(positions, self.device)
            if inputs_taken is not None:
                inputs_taken.record()
            out = self.model(ids, positions, self.backend, batch, layers)
            hidden, aux_cat = out.hidden, out.aux
        return hidden, self._split_aux(aux_cat, layers)

    def _pick(self, req: TargetRequest, logits: torch.Tensor) -> list[int]:
        if req.sampling.greedy:
            return logits.argmax(-1).tolist()
        probs = _host_probs(logits, req.sampling)
        return [sample(p, req.generator) for p in probs]


def _host_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The request's filtered probabilities, computed where the logits are and read on the host: the acceptance
    walk and the draws (CPU generators, per-node reads) then cost one copy instead of a sync per node, and give
    the same draws on every device. # [n, vocab] float32 on the CPU"""
    return target_probs(logits, sampling).cpu()
